"""The reference video engine: Hugging Face diffusers' own pipeline (WanPipeline for Wan 2.1 /
2.2 text-to-video), on CPU or CUDA. Its frames are diffusers' frames: the equivalence test
compares them with `WanPipeline.__call__` run directly."""
from __future__ import annotations

import logging
from typing import Any

from tandem.video import pipelines
from tandem.video.config import VideoEngineArgs
from tandem.video.engine import StepHook, VideoEngine
from tandem.video.params import ResolvedParams

log = logging.getLogger(__name__)


def torch_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def torch_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


class DiffusersVideoEngine(VideoEngine):
    name = "reference"

    def __init__(self, args: VideoEngineArgs) -> None:
        self.args = args
        self.class_name = pipelines.pipeline_class_name(args.model)
        self.device = torch_device(args.device)
        self.dtype = torch_dtype(args.dtype, self.device)
        self._pipe: Any = None

    def load(self) -> None:
        import diffusers
        import torch

        pipeline_cls = getattr(diffusers, self.class_name)
        # The VAE decodes in float32 whatever the transformer's dtype (as Wan's own code does:
        # a bfloat16 decode bands the colours).
        vae = diffusers.AutoencoderKLWan.from_pretrained(self.args.model, subfolder="vae",
                                                         torch_dtype=torch.float32)
        pipe = pipeline_cls.from_pretrained(self.args.model, vae=vae, torch_dtype=self.dtype)
        pipe.set_progress_bar_config(disable=True)
        if self.args.enable_async_cpu_offload and self.device.startswith("cuda"):
            pipe.enable_model_cpu_offload(device=self.device)
        else:
            pipe.to(self.device)
        if self.args.enable_torch_compile:
            pipe.transformer.compile(mode=self.args.torch_compile_mode)
        self._pipe = pipe
        self._spec = pipelines.spec_of(pipe, self.class_name)
        log.info("video pipeline loaded", extra={"pipeline": self.class_name,
                                                 "device": self.device,
                                                 "dtype": str(self.dtype)})

    def generate(self, params: ResolvedParams, on_step: StepHook) -> Any:
        import torch

        with torch.inference_mode():
            return pipelines.run(self._pipe, params, on_step)

    def close(self) -> None:
        self._pipe = None


def create_reference_video_engine(args: VideoEngineArgs) -> VideoEngine:
    return DiffusersVideoEngine(args)
