"""The `trtllm` video engine: TensorRT-LLM's visual generation package (`visual_gen`, shipped in
NVIDIA/TensorRT-LLM under tensorrt_llm/visual_gen/), driven the way Dynamo's TensorRT-LLM
diffusion worker drives it (ai-dynamo/dynamo components/src/dynamo/trtllm/engines/
diffusion_engine.py at dcada700):

1. the diffusers `_class_name` in model_index.json picks the visual_gen pipeline class
   (WanPipeline -> visual_gen.pipelines.wan_pipeline.ditWanPipeline);
2. `visual_gen.setup_configs(**dit_configs)` sets the process-wide kernel, compile,
   parallelism and TeaCache configuration (pipeline / attn / linear / parallel / teacache);
3. `ditWanPipeline.from_pretrained(model, torch_dtype=..., **dit_configs)` loads it, then it
   moves to the GPU, or `enable_async_cpu_offload` streams blocks from CPU memory;
4. the call is diffusers' WanPipeline signature (ditWanPipeline inherits WanPipeline), so the
   per-step hook rides on `callback_on_step_end` exactly as in the reference engine.

visual_gen needs TensorRT-LLM's GPU stack, which cannot be installed where Tandem is developed:
this adapter is checked against a fake built from visual_gen's source (tests/fakes/visual_gen).
"""
from __future__ import annotations

import importlib
import json
import logging
import pathlib
from typing import Any

from tandem.errors import InvalidRequest, Unavailable
from tandem.video import pipelines
from tandem.video.config import VideoEngineArgs
from tandem.video.engine import StepHook, VideoEngine
from tandem.video.params import ResolvedParams
from tandem.video.reference import torch_device, torch_dtype

log = logging.getLogger(__name__)
INSTALL_HINT = (
    "the trtllm video engine needs TensorRT-LLM's visual_gen package, which is not installed "
    "here: install it from TensorRT-LLM's tensorrt_llm/visual_gen/ (pip install .) or run in "
    "NVIDIA's TensorRT-LLM container; elsewhere use --engine reference")
#: diffusers pipeline class -> visual_gen (module, class), as Dynamo's PIPELINE_REGISTRY.
VISUAL_GEN_PIPELINES: dict[str, tuple[str, str]] = {
    "WanPipeline": ("visual_gen.pipelines.wan_pipeline", "ditWanPipeline"),
}


def dit_configs(args: VideoEngineArgs, model_index: dict[str, Any],
                default_steps: int) -> dict[str, Any]:
    """visual_gen's configuration, keyed and valued as Dynamo's `_build_dit_configs` (one GPU:
    every parallel size 1; TeaCache off). Every transformer of the model (Wan 2.2 has two) is
    compiled when compiling. Unlike Dynamo, a component the index lists as absent
    (`"transformer_2": [null, null]`, as diffusers now writes for Wan 2.1) is not named: visual_gen
    would refuse to compile a model the pipeline does not have."""
    transformers = sorted(k for k, v in model_index.items()
                          if k.startswith("transformer") and isinstance(v, list) and v[0])
    return {
        "pipeline": {"enable_torch_compile": args.enable_torch_compile,
                     "torch_compile_models": ",".join(transformers) or "transformer",
                     "torch_compile_mode": args.torch_compile_mode, "fuse_qkv": True},
        "attn": {"type": args.attn_type},
        "linear": {"type": args.linear_type, "recipe": "dynamic"},
        "parallel": {"disable_parallel_vae": False, "parallel_vae_split_dim": "width",
                     "dit_dp_size": 1, "dit_tp_size": 1, "dit_ulysses_size": 1,
                     "dit_ring_size": 1, "dit_cp_size": 1, "dit_cfg_size": 1,
                     "dit_fsdp_size": 1, "t5_fsdp_size": 1},
        "teacache": {"enable_teacache": False, "use_ret_steps": True, "teacache_thresh": 0.2,
                     "ret_steps": 0, "cutoff_steps": default_steps},
    }


class VisualGenVideoEngine(VideoEngine):
    name = "trtllm"

    def __init__(self, args: VideoEngineArgs, default_steps: int = 50) -> None:
        self.args = args
        self.class_name = pipelines.pipeline_class_name(args.model)
        if self.class_name not in VISUAL_GEN_PIPELINES:
            raise InvalidRequest(f"visual_gen has no pipeline for {self.class_name}; supported: "
                                 f"{', '.join(VISUAL_GEN_PIPELINES)}", param="model")
        self.model_index = json.loads((pathlib.Path(args.model) / "model_index.json")
                                      .read_text("utf-8"))
        self.default_steps = default_steps
        self.device = torch_device(args.device)
        self._pipe: Any = None

    def load(self) -> None:
        try:
            visual_gen = importlib.import_module("visual_gen")
            module_name, class_name = VISUAL_GEN_PIPELINES[self.class_name]
            pipeline_cls = getattr(importlib.import_module(module_name), class_name)
        except ImportError as exc:
            raise Unavailable(f"{INSTALL_HINT} ({exc})", param="engine") from exc
        configs = dit_configs(self.args, self.model_index, self.default_steps)
        visual_gen.setup_configs(**configs)
        # visual_gen's own error for a model it has no TeaCache coefficients for (its path
        # must name the size, e.g. Wan2.1-T2V-1.3B-Diffusers) is a ValueError: say which flag.
        try:
            pipe = pipeline_cls.from_pretrained(self.args.model,
                                                torch_dtype=torch_dtype(self.args.dtype,
                                                                        self.device),
                                                **configs)
        except ValueError as exc:
            raise InvalidRequest(f"visual_gen cannot load --model {self.args.model}: {exc}",
                                 param="model") from exc
        pipe.set_progress_bar_config(disable=True)
        if self.args.enable_async_cpu_offload:
            pipe.enable_async_cpu_offload(model_wise=["text_encoder"], block_wise=["transformer"],
                                          offloading_stride=1)
        else:
            pipe.to(self.device)
        self._pipe = pipe
        self._spec = pipelines.spec_of(pipe, self.class_name)
        log.info("visual_gen pipeline loaded", extra={"pipeline": class_name,
                                                      "attn": self.args.attn_type,
                                                      "linear": self.args.linear_type})

    def generate(self, params: ResolvedParams, on_step: StepHook) -> Any:
        return pipelines.run(self._pipe, params, on_step)

    def close(self) -> None:
        self._pipe = None


def create_trtllm_video_engine(args: VideoEngineArgs) -> VideoEngine:
    return VisualGenVideoEngine(args)
