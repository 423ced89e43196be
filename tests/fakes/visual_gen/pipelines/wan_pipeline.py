"""visual_gen/pipelines/wan_pipeline.py (upstream commit 4d31ff8e): `ditWanPipeline(WanPipeline,
ditBasePipeline)`.

`_after_load` looks up TeaCache coefficients by the model path first, whether or not TeaCache is
on, and raises ValueError("Model <path> not supported for TeaCache") unless the path names
"1.3B" or "14B" (so a checkpoint directory must keep its size in its name); it then sets
PipelineConfig from the `pipeline` section (with transformer_type "ditWanTransformer3DModel").
Upstream's `__call__` is its own copy of WanPipeline's loop (plus TeaCache, data-parallel split
and offload hooks) with the same signature, `callback_on_step_end(pipe, i, t, kwargs)` after
every step and `self.interrupt` checked before each; the fake inherits WanPipeline's, which does
the same for the paths Tandem takes. The kernels named in setup_configs are checked to exist.
"""
from __future__ import annotations

from typing import Any

from diffusers import WanPipeline

from visual_gen.configs.diffusion_cache import TeaCacheConfig
from visual_gen.configs.op_manager import AttentionOpManager, LinearOpManager
from visual_gen.configs.pipeline import PipelineConfig

from .base_pipeline import ditBasePipeline


class ditWanPipeline(WanPipeline, ditBasePipeline):  # noqa: N801 - upstream's name
    def _set_teacache_coefficients(self, pretrained_model_name_or_path: str,
                                   **kwargs: Any) -> None:
        if not any(size in pretrained_model_name_or_path for size in ("1.3B", "14B")):
            raise ValueError(f"Model {pretrained_model_name_or_path} not supported for TeaCache")
        TeaCacheConfig.set_config(ret_steps=(5 if TeaCacheConfig.use_ret_steps() else 1) * 2)

    def _after_load(self, pretrained_model_name_or_path: str, *args: Any, **kwargs: Any) -> None:
        self._set_teacache_coefficients(pretrained_model_name_or_path, **kwargs)
        pipe_config = dict(kwargs.get("pipeline", {}))
        pipe_config["transformer_type"] = "ditWanTransformer3DModel"
        PipelineConfig.set_config(**pipe_config)
        AttentionOpManager.check(AttentionOpManager.attn_type)
        LinearOpManager.check(LinearOpManager.linear_type)
