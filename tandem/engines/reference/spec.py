"""ModelSpec: the shape of a decoder-only checkpoint, read once from its config.json.

Everything the reference engine builds (modules, KV pool, RoPE tables) is sized from this object,
so the engine never reads config.json itself. Both config layouts are understood: transformers
4.x (`rope_theta` and `rope_scaling` at top level, `torch_dtype`) and 5.x (`rope_parameters`
holding the theta, `dtype`).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engines.reference import rope
from tandem.errors import InvalidRequest
from tandem.multimodal.placeholders import LLAVA_ARCHITECTURES

#: Architectures (config.json "architectures"[0]) this engine runs, mapped to their family.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
#: Families whose MLPs are (some or all) sparse mixtures of experts.
MOE_FAMILIES = frozenset({"mixtral", "qwen3_moe", "gpt_oss"})
#: gpt-oss's defaults where its config.json is silent (transformers' GptOssConfig).
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
_GPT_OSS_THETA = 150000.0

#: Base-model architectures (embedding checkpoints) -> the causal LM whose body they are.
BASE_MODELS = {arch.replace("ForCausalLM", "Model"): arch for arch in SUPPORTED_ARCHITECTURES}
#: The text_config model_type of a multimodal model -> the matching causal-LM architecture.
_TEXT_MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelSpec:
    """Shape and numerics of one checkpoint. Immutable; build it with `from_dir`/`from_config`."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    #: Per-head dimension; Qwen3 sets it apart from hidden_size // num_heads.
    head_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    #: None for plain RoPE, else a dict with "rope_type" ("llama3" or "yarn") and its keys.
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    #: Bias on q/k/v projections (always on for Qwen2).
    attention_bias: bool
    #: Bias on o_proj (Llama/Qwen3 `attention_bias`; never for Qwen2).
    attention_out_bias: bool
    mlp_bias: bool
    #: Per-head RMSNorm on q and k before RoPE (Qwen3).
    qk_norm: bool
    tie_word_embeddings: bool
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    #: Per layer: None for full attention, else the window W (a query at p sees keys > p - W).
    sliding_windows: tuple[int | None, ...]
    #: The multimodal model wrapping this language model ("LlavaForConditionalGeneration"),
    #: whose checkpoint nests the language model's tensors; None for a plain causal LM.
    wrapper: str | None = None
    #: Experts per sparse MLP; 0 for a dense model.
    num_experts: int = 0
    #: Experts each token is routed to (top-k).
    num_experts_per_tok: int = 0
    #: Intermediate size of one expert (a dense layer of an MoE model uses `intermediate_size`).
    moe_intermediate_size: int = 0
    #: Whether the top-k routing probabilities are divided by their sum (always for Mixtral,
    #: Qwen3-MoE's `norm_topk_prob`).
    norm_topk_prob: bool = False
    #: Whether expert outputs are weighted by the float32 routing weights (Mixtral) rather than
    #: by weights cast to the model dtype first (Qwen3-MoE), as in transformers.
    router_weights_float32: bool = False
    #: Per layer: True where the MLP is a sparse MoE block; empty for a dense model.
    sparse_layers: tuple[bool, ...] = ()
    #: Which sparse block: "softmax_topk" (Mixtral, Qwen3-MoE: bias-free router, softmax over
    #: all experts, then top-k; SwiGLU experts) or "gpt_oss" (router with bias, top-k logits,
    #: then softmax over those; experts with biases and the clamped SwiGLU below).
    moe_kind: str = "softmax_topk"
    #: gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
    #: g = clamp(gate, max=limit).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    #: A learned logit per query head that joins each softmax's denominator and attends to no
    #: value (gpt-oss's attention sinks).
    attention_sinks: bool = False
    #: The checkpoint is the base model (`LlamaModel`, ...: tensor names without "model.", no
    #: lm_head), as embedding models are saved: fit for embeddings only.
    base_model: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> ModelSpec:
        """Read `path/config.json`. Raises InvalidRequest (param="model") if the file is missing
        or unreadable or the model is outside what this engine supports."""
        config_path = pathlib.Path(path) / "config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"cannot read {config_path}: {exc}", param="model") from exc
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Build from a parsed config.json. Raises InvalidRequest as `from_dir` does.

        A LLaVA config gives the spec of its language model (`text_config`)."""
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else "<none>"
        if architecture in LLAVA_ARCHITECTURES:
            return dataclasses.replace(cls.from_config(_text_config(config)),
                                       wrapper=architecture)
        causal = BASE_MODELS.get(architecture)
        if causal is not None:
            return dataclasses.replace(cls.from_config({**config, "architectures": [causal]}),
                                       base_model=True)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise InvalidRequest(
                f"unsupported model architecture {architecture!r}; the reference engine supports "
                f"{', '.join(sorted({*SUPPORTED_ARCHITECTURES, *LLAVA_ARCHITECTURES}))}",
                param="model")
        family = SUPPORTED_ARCHITECTURES[architecture]
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidRequest(f"unsupported hidden_act {act!r}; only 'silu' is supported",
                                 param="model")

        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        num_layers = int(config["num_hidden_layers"])
        if family == "gpt_oss":  # transformers fills these in when the config is silent
            config = {"rope_theta": _GPT_OSS_THETA, **config}
            if not (config.get("rope_parameters") or config.get("rope_scaling")):
                config["rope_parameters"] = dict(_GPT_OSS_ROPE)
        rope_theta, rope_scaling = _rope_params(config)
        max_pos = int(config.get("max_position_embeddings", 2048))
        rope.check_scaling(rope_scaling)

        # Qwen2 hard-codes q/k/v bias and no o_proj bias; Llama and Qwen3 put both behind one flag.
        # gpt-oss has both unless its config says otherwise.
        has_bias = bool(config.get("attention_bias", family == "gpt_oss"))
        attention_bias = family == "qwen2" or has_bias
        attention_out_bias = family != "qwen2" and has_bias

        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_size=int(config.get("head_dim") or hidden_size // num_heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps",
                                          1e-5 if family == "gpt_oss" else 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            attention_bias=attention_bias,
            attention_out_bias=attention_out_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=_dtype(config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos_ids(config.get("eos_token_id")),
            sliding_windows=_sliding_windows(config, family, num_layers),
            attention_sinks=family == "gpt_oss",
            **_moe_fields(config, family, num_layers),
        )


def _moe_fields(config: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of ModelSpec, mirroring transformers: Mixtral is sparse on every layer and
    always renormalises; Qwen3-MoE is sparse on layer i when i is not in `mlp_only_layers` and
    (i + 1) is a multiple of `decoder_sparse_step`. transformers 5 saves the expert count as
    `num_local_experts` for both; Qwen3-MoE checkpoints on the Hub call it `num_experts`."""
    if family not in MOE_FAMILIES:
        return {}
    num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if family in ("mixtral", "gpt_oss"):
        sparse = (num_experts > 0,) * num_layers
        expert_size = int(config["intermediate_size"])
    else:
        dense_only = set(config.get("mlp_only_layers") or ())
        step = int(config.get("decoder_sparse_step") or 1)
        sparse = tuple(num_experts > 0 and i not in dense_only and (i + 1) % step == 0
                       for i in range(num_layers))
        expert_size = int(config["moe_intermediate_size"])
    top_k = int(config["num_experts_per_tok"])
    if num_experts and not 0 < top_k <= num_experts:
        raise InvalidRequest(f"num_experts_per_tok={top_k} is outside 1..{num_experts} "
                             "experts", param="model")
    fields: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": family == "mixtral" or bool(config.get("norm_topk_prob", False)),
        "router_weights_float32": family == "mixtral",
        "sparse_layers": sparse,
    }
    if family == "gpt_oss":
        fields.update(moe_kind="gpt_oss", norm_topk_prob=False,
                      swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(config.get("swiglu_limit", 7.0)))
    return fields


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A LLaVA config's language model as a causal-LM config of its own."""
    text = dict(config.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if not text.get("architectures"):
        if model_type not in _TEXT_MODEL_TYPES:
            raise InvalidRequest(f"unsupported language model {model_type!r} in a "
                                 f"{config['architectures'][0]}", param="model")
        text["architectures"] = [_TEXT_MODEL_TYPES[model_type]]
    if not (text.get("dtype") or text.get("torch_dtype")):
        text["dtype"] = config.get("dtype") or config.get("torch_dtype") or "float32"
    return text


def _rope_params(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from either config layout; "type" is the 4.x spelling."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):  # transformers prefers a top-level value (Phi-3)
        original = (config.get("original_max_position_embeddings")
                    or params.get("original_max_position_embeddings")
                    or config.get("max_position_embeddings", 2048))
        params["original_max_position_embeddings"] = original
    return theta, params


def _dtype(config: Mapping[str, Any]) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise InvalidRequest(f"unsupported dtype {name!r} in config.json; supported: "
                             f"{', '.join(sorted(_DTYPES))}", param="model")
    return _DTYPES[name]


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_windows(config: Mapping[str, Any], family: str,
                     num_layers: int) -> tuple[int | None, ...]:
    """Mirror transformers: Mistral and Mixtral slide on every layer when `sliding_window` is
    set; Qwen3-MoE on every layer with `use_sliding_window`; Qwen2/3 only with
    `use_sliding_window`, on the layers `layer_types` (or `max_window_layers`) marks; gpt-oss
    on the layers `layer_types` marks (by default the even ones)."""
    window = config.get("sliding_window")
    if family == "gpt_oss":
        window = config.get("sliding_window", 128)  # GptOssConfig's default
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        return tuple(int(window) if window and t == "sliding_attention" else None
                     for t in layer_types)
    if family in ("mistral", "mixtral"):
        return (int(window) if window else None,) * num_layers
    if family == "qwen3_moe":
        slides = config.get("use_sliding_window")
        return (int(window) if slides and window else None,) * num_layers
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window") and window:
        layer_types = config.get("layer_types")
        if layer_types is None:
            first = int(config.get("max_window_layers", num_layers))
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return (None,) * num_layers
