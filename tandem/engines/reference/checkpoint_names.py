"""How checkpoint tensor names map to the reference engine's modules: the causal-LM name of a
base model's or a multimodal model's tensors, Mixtral's expert names, LLaVA's vision tower."""
from __future__ import annotations

from collections.abc import Callable

# Mixtral's checkpoint names for its MoE block and expert projections -> the canonical
# (Qwen3-MoE) ones; transformers 5 still saves these per-expert names.
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                  (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def is_unused(name: str, num_layers: int) -> bool:
    """Tower tensors LLaVA never reads: layers past the feature layer, the pooled output's
    norm, and buffers older checkpoints saved."""
    if name.startswith("vision_tower.post_layernorm.") or name.endswith(".position_ids"):
        return True
    prefix = "vision_tower.encoder.layers."
    return name.startswith(prefix) and int(name[len(prefix):].split(".")[0]) >= num_layers


def vision_name(name: str) -> str | None:
    """A LLaVA checkpoint's vision tower or projector tensor -> LlavaVision's name; None for
    the language model's tensors."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name[len("vision_tower.vision_model."):]
    if name.startswith(("vision_tower.", "multi_modal_projector.")):
        return name
    return None


def same_name(name: str) -> str | None:
    return name


def base_name(name: str) -> str | None:
    """A base-model checkpoint's tensor name (no "model." prefix) -> the causal-LM name."""
    return name if name.startswith("model.") else f"model.{name}"


def then_mixtral_name(rename: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """`rename`, then Mixtral's MoE names (`block_sparse_moe`, `w1`/`w3`/`w2`) -> canonical."""
    def mixtral_name(name: str) -> str | None:
        result = rename(name)
        if result is None:
            return None
        for old, new in _MIXTRAL_NAMES:
            result = result.replace(old, new)
        return result
    return mixtral_name


# A LLaVA checkpoint nests the language model: "language_model.model." (transformers 4.x and
# the Hub's llava-hf checkpoints) or "model.language_model." (transformers 5 in memory).
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def text_name(name: str) -> str | None:
    """A multimodal checkpoint's name for a language-model tensor -> the causal-LM name;
    None for the other tensors (vision tower, projector)."""
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None
