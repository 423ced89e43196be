"""Tiny test models: real Hugging Face checkpoints of each supported family, random weights.

`write_tiny_model` builds the transformers model class itself and saves it with
`save_pretrained`, so transformers loads the very same files the engine under test reads, and
copies the demo tokenizer beside them. Weights are drawn from a fixed seed with a larger spread
than transformers' init (std 0.02 gives near-uniform logits, so greedy decoding would be decided
by rounding noise and equivalence tests would prove little).
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

#: Family name -> (transformers config class, family-specific config keys).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"head_dim": 16}),
    # Llama 3.1 RoPE with a short original context, so scaled, smoothed and kept frequencies all
    # occur among the 8 frequencies of a 16-wide head. Untied, unlike the other families.
    "llama3": ("LlamaConfig", {
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64},
    }),
    # A window shorter than the test prompts, so the sliding-window mask is exercised.
    "mistral": ("MistralConfig", {"head_dim": 16, "sliding_window": 24}),
    # Qwen2 always has q/k/v bias.
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    # Qwen3: per-head q/k RMSNorm, and a head_dim unlike hidden/heads, as in real Qwen3 models.
    "qwen3": ("Qwen3Config", {"head_dim": 32, "attention_bias": False,
                              "use_sliding_window": False}),
    # Mixtral: every MLP sparse, 4 experts of width 128, top-2 renormalised; no window, as in
    # Mixtral-8x7B.
    "mixtral": ("MixtralConfig", {"head_dim": 16, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "sliding_window": None}),
    # Qwen3-MoE: q/k norm, 4 experts of width 48, top-2 renormalised as in Qwen3-30B-A3B; layer
    # 1 dense (mlp_only_layers, width intermediate_size), so both layer kinds occur.
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 48, "norm_topk_prob": True,
                                     "mlp_only_layers": [1], "use_sliding_window": False}),
    # gpt-oss: attention biases and sinks; layers alternate sliding (window 8, one KV block of
    # the tests) and full; YaRN with an original context of 64 (factor 8 = 512 / 64), so one
    # of the 8 frequencies of a 16-wide head is kept, one blended and the rest interpolated;
    # 4 biased experts of width 128, top-2. swiglu_limit 2 (gpt-oss: 7) makes the clamps bite
    # at these weights. Untied, as gpt-oss is.
    "gpt_oss": ("GptOssConfig", {
        "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 2.0,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 64},
    }),
}
#: Std of the random matrices; norm weights are 1 + N(0, 0.1^2), biases N(0, 0.1^2).
WEIGHT_STD = 0.2
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tiny_model(path: str | pathlib.Path, family: str, seed: int = 0, *,
                     tokenizer_dir: str | pathlib.Path | None = None,
                     **overrides: Any) -> pathlib.Path:
    """Write a tiny float32 `family` checkpoint (config, safetensors, tokenizer) into `path`.

    Args:
        family: one of FAMILIES ("llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral",
            "qwen3_moe", "gpt_oss").
        seed: decides every weight; the same seed gives the same tensors.
        tokenizer_dir: where tokenizer.json and tokenizer_config.json come from (and the special
            token ids, from its config.json); default: the demo model (built on first use).
        overrides: transformers config keys that replace the defaults (e.g. num_hidden_layers).
    Returns:
        The directory, loadable by `AutoModelForCausalLM.from_pretrained`.
    Raises:
        ValueError: unknown family.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(FAMILIES)}")
    if tokenizer_dir is None:
        from tandem.model.demo import ensure_demo_model

        tokenizer_dir = ensure_demo_model()
    tokenizer_dir = pathlib.Path(tokenizer_dir)
    token_config = json.loads((tokenizer_dir / "config.json").read_text("utf-8"))

    config_name, family_keys = FAMILIES[family]
    kwargs: dict[str, Any] = {
        "vocab_size": token_config["vocab_size"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": token_config.get("bos_token_id"),
        "eos_token_id": token_config.get("eos_token_id"),
        "pad_token_id": token_config.get("pad_token_id"),
        **family_keys,
        **overrides,
    }
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)  # whatever transformers' own init draws is then fixed too
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)

    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, root / name)
    return root


def randomize(model: Any, seed: int) -> None:
    """Redraw every parameter from `seed` in name order (independent of module order)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith(".bias"):  # LayerNorm biases too (RMSNorm has none)
                param.copy_(0.1 * noise)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(WEIGHT_STD * noise)
