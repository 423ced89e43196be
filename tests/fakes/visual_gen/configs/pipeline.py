"""visual_gen/configs/pipeline.py (upstream commit 238bf38e): a class-level singleton whose
`set_config` sets known attributes and raises AttributeError for any other key."""
from __future__ import annotations

from typing import Any


class PipelineConfig:
    transformer_type: str | None = None
    model_wise_offloading: list[str] = []
    block_wise_offloading: list[str] = []
    offloading_stride = 0
    enable_torch_compile = True
    torch_compile_models: Any = []
    torch_compile_mode = "default"
    fuse_qkv = True
    num_inference_steps: int | None = None

    @classmethod
    def set_config(cls, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if not hasattr(cls, key):
                raise AttributeError(f"'{cls.__name__}' has no attribute '{key}'")
            setattr(cls, key, value)
