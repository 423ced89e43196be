"""A fake of TensorRT-LLM's `visual_gen` package for Tandem's tests (see tests/fakes/README.md).

Upstream: NVIDIA/TensorRT-LLM, tensorrt_llm/visual_gen/visual_gen/ (the package Dynamo's
diffusion worker imports as `visual_gen`). Kept: the import paths Dynamo and Tandem use
(`visual_gen.setup_configs`, `visual_gen.pipelines.wan_pipeline.ditWanPipeline`), the five
config sections and the keys they require, the class-level config singletons that reject unknown
keys, `ditBasePipeline.from_pretrained`'s order (diffusers load, class swap, `_after_load`,
FSDP, torch.compile), the TeaCache coefficient lookup that refuses a model path naming neither
"1.3B" nor "14B", and `enable_async_cpu_offload`'s argument checks. Not kept: the CUDA kernels
(attention, FP8/NVFP4 linears), the fused-QKV and parallel transformer/VAE replacements, and
distributed initialisation: the pipeline runs diffusers' own WanPipeline modules on CPU, so its
frames equal diffusers'.
"""
from __future__ import annotations

from .utils import create_default_dit_configs, setup_configs

IS_TANDEM_FAKE = True

__all__ = ["setup_configs", "create_default_dit_configs"]
