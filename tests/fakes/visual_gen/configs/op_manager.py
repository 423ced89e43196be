"""visual_gen/configs/op_manager.py (upstream commit 8c6e7d84): attention and linear kernel
managers. `set_*_config` rejects unknown keys (AttributeError); a kernel name is looked up in
the registry when an op runs (upstream: at the first forward, ValueError "... not found in
registry"; the fake checks it when the pipeline loads). The registered names are those
visual_gen ships and Dynamo offers (--attn-type, --linear-type)."""
from __future__ import annotations

from typing import Any

ATTENTION_TYPES = ("default", "sage-attn", "sparse-videogen", "sparse-videogen2",
                   "trtllm-attn", "flash-attn3", "flash-attn3-fp8")
LINEAR_TYPES = ("default", "trtllm-fp8-blockwise", "trtllm-fp8-per-tensor", "trtllm-nvfp4",
                "svd-nvfp4")


class _Manager:
    registry: tuple[str, ...] = ()
    kind = ""

    @classmethod
    def _set(cls, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if not hasattr(cls, key):
                raise AttributeError(f"'{cls.__name__}' has no attribute '{key}'")
            setattr(cls, key, value)

    @classmethod
    def check(cls, name: str) -> None:
        if name not in cls.registry:
            raise ValueError(f"{cls.kind} function {name} not found in registry")


class AttentionOpManager(_Manager):
    registry = ATTENTION_TYPES
    kind = "Attention"
    attn_type = "default"
    attn_choices: Any = ["default", "sage-attn"]

    @classmethod
    def set_attn_config(cls, **kwargs: Any) -> None:
        cls._set(**kwargs)


class LinearOpManager(_Manager):
    registry = LINEAR_TYPES
    kind = "Linear"
    linear_type = "default"
    linear_recipe = "dynamic"
    linear_choices: Any = ["default"]

    @classmethod
    def set_linear_config(cls, **kwargs: Any) -> None:
        cls._set(**kwargs)
