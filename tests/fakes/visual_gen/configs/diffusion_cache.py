"""visual_gen/configs/diffusion_cache.py (upstream commit 4d31ff8e): TeaCache settings as class
attributes; `use_ret_steps` defaults to False."""
from __future__ import annotations

from typing import Any


class TeaCacheConfig:
    _enable_teacache = False
    _teacache_thresh = 0.2
    _use_ret_steps = False
    _ret_steps: int | None = None

    @classmethod
    def set_config(cls, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if value is not None:
                setattr(cls, f"_{key}", value)

    @classmethod
    def use_ret_steps(cls) -> bool:
        return cls._use_ret_steps

    @classmethod
    def enable_teacache(cls) -> bool:
        return cls._enable_teacache
