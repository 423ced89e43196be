"""Tiny EAGLE-3 heads for tests: checkpoints laid out as published EAGLE-3 heads are
(tandem.engines.speculative.eagle3_head: config.json with architectures
`LlamaForCausalLMEagle3`, `midlayer.*` safetensors, `d2t`, `t2d`), random weights from a seed,
for a tiny target of tandem.model.tiny.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

#: Std of the random matrices (tandem.model.tiny's).
WEIGHT_STD = 0.2


def eagle3_config(target: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A head's config.json for a target's config (its hidden size, vocabulary, RoPE)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": target["vocab_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": [0, 1, target["num_hidden_layers"]],
    }
    config.update(overrides)
    return config


def eagle3_tensors(config: dict[str, Any], seed: int, *, target_hidden: int | None = None,
                   embed: bool = False) -> dict[str, torch.Tensor]:
    """Random tensors of the published layout for `config` (d2t: a sorted random subset of
    the vocabulary when the draft vocabulary is smaller; t2d its mask)."""
    g = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    target_hidden = target_hidden or hidden
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    draft_vocab = config["draft_vocab_size"]
    n = len(config["eagle_aux_hidden_state_layer_ids"])

    def matrix(*shape: int) -> torch.Tensor:
        return WEIGHT_STD * torch.randn(*shape, generator=g)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=g)

    layer = "midlayer."
    tensors = {
        "fc.weight": matrix(hidden, n * target_hidden) / n ** 0.5,
        layer + "input_layernorm.weight": norm(),
        layer + "hidden_norm.weight": norm(),
        layer + "self_attn.q_proj.weight": matrix(heads * head_dim, 2 * hidden),
        layer + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
        layer + "post_attention_layernorm.weight": norm(),
        layer + "mlp.gate_proj.weight": matrix(inter, hidden),
        layer + "mlp.up_proj.weight": matrix(inter, hidden),
        layer + "mlp.down_proj.weight": matrix(hidden, inter),
        "norm.weight": norm(),
        "lm_head.weight": matrix(draft_vocab, hidden),
    }
    if embed:
        tensors["embed_tokens.weight"] = matrix(vocab, hidden)
    if draft_vocab < vocab:
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    return tensors


def write_eagle3(path: str | pathlib.Path, config: dict[str, Any],
                 tensors: dict[str, torch.Tensor]) -> pathlib.Path:
    """Writes config.json and model.safetensors into `path`."""
    from safetensors.torch import save_file

    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2), "utf-8")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    return root


def write_tiny_eagle3(path: str | pathlib.Path, target_dir: str | pathlib.Path, seed: int = 0,
                      *, embed: bool = False, **overrides: Any) -> pathlib.Path:
    """A random EAGLE-3 head for the tiny target in `target_dir`; `overrides` replace config
    keys (e.g. draft_vocab_size)."""
    target = json.loads((pathlib.Path(target_dir) / "config.json").read_text("utf-8"))
    config = eagle3_config(target, **overrides)
    return write_eagle3(path, config, eagle3_tensors(config, seed, embed=embed))
