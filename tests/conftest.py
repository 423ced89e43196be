"""What every test run shares: transformers as the reference honours gpt_oss's SwiGLU config.

The reference engine's gpt_oss reads `swiglu_alpha` and `swiglu_limit` from config.json, and the
tiny gpt_oss model sets the limit to 2 (the real checkpoints' 7.0 never clamps random weights).
transformers reads both from the config since 5.19.0; 5.18 and before (the GPU image has 5.17)
hard-code 1.702 and 7.0 in GptOssExperts. Against those releases every comparison with the tiny
model differed for a reason that is not ours, so the reference experts take the config's
constants, as newer releases do. With the real models' values nothing changes.
"""
from __future__ import annotations

import functools
from typing import Any


def _honour_gpt_oss_swiglu_config() -> None:
    try:
        from transformers.models.gpt_oss import modeling_gpt_oss
    except ImportError:
        return
    experts = modeling_gpt_oss.GptOssExperts
    original = experts.__init__

    @functools.wraps(original)
    def init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, config, *args, **kwargs)
        self.alpha = getattr(config, "swiglu_alpha", self.alpha)
        self.limit = getattr(config, "swiglu_limit", self.limit)

    experts.__init__ = init


def pytest_configure() -> None:
    _honour_gpt_oss_swiglu_config()
