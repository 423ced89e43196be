"""visual_gen/utils/setup_configs.py (upstream commit 4b0b5ca0): defaults from
`create_default_dit_configs`, updated section by section with the caller's dict (a section
given replaces the default section whole, as upstream's `dict.update`), then each section set.
`attn` needs "type"; `linear` needs "type" and "recipe" (KeyError otherwise, as upstream).
Parallel sizes above 1 need a distributed launch, which the fake refuses."""
from __future__ import annotations

import os
from typing import Any

from visual_gen.configs.diffusion_cache import TeaCacheConfig
from visual_gen.configs.op_manager import AttentionOpManager, LinearOpManager
from visual_gen.configs.pipeline import PipelineConfig

#: The last configs given to setup_configs (fake-only, for tests).
last_configs: dict[str, Any] = {}


def create_default_dit_configs() -> dict[str, Any]:
    return {
        "pipeline": {"enable_torch_compile": True, "torch_compile_models": "transformer",
                     "torch_compile_mode": "default", "fuse_qkv": True},
        "attn": {"type": "default", "choices": "default,sage-attn"},
        "linear": {"type": "default", "recipe": "dynamic",
                   "choices": "default,trtllm-fp8-blockwise,trtllm-fp8-per-tensor"},
        "parallel": {"disable_parallel_vae": False, "parallel_vae_split_dim": "width",
                     "dit_dp_size": 1, "dit_tp_size": 1, "dit_ulysses_size": 1,
                     "dit_ring_size": 1, "dit_cp_size": 1, "dit_cfg_size": 1,
                     "dit_fsdp_size": 1, "t5_fsdp_size": 1},
        "teacache": {"enable_teacache": False, "use_ret_steps": True, "teacache_thresh": 0.2,
                     "ret_steps": 0, "cutoff_steps": 50},
    }


def _parallel(**config: Any) -> None:
    sizes = {k: v for k, v in config.items() if k.endswith("_size")}
    if any(v != 1 for v in sizes.values()) and int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        raise RuntimeError(f"fake visual_gen: parallel sizes {sizes} need a distributed launch")


def setup_configs(**kwargs: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    configs = create_default_dit_configs()
    configs.update(kwargs)
    PipelineConfig.set_config(**configs.get("pipeline", {}))
    attn = configs.get("attn", {})
    AttentionOpManager.set_attn_config(attn_type=attn["type"],
                                       attn_choices=attn.get("choices", ["default", "sage-attn"]))
    linear = configs.get("linear", {})
    LinearOpManager.set_linear_config(linear_type=linear["type"], linear_recipe=linear["recipe"],
                                      linear_choices=linear.get("choices", ["default"]))
    teacache = configs.get("teacache", {})
    if teacache.get("enable_teacache", False):
        TeaCacheConfig.set_config(enable_teacache=True,
                                  use_ret_steps=teacache.get("use_ret_steps", True),
                                  teacache_thresh=teacache.get("teacache_thresh", 0.2))
    _parallel(**configs.get("parallel", {}))
    last_configs.clear()
    last_configs.update(configs)
