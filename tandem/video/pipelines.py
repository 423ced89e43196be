"""Diffusers-style pipelines behind the video engines: which pipeline classes Tandem drives, how
their constraints are read, and the one call that runs them with a per-step hook.

Both backends run a `diffusers.WanPipeline` or a subclass of it (TensorRT-LLM's
`visual_gen.pipelines.wan_pipeline.ditWanPipeline` inherits WanPipeline and keeps its
`__call__` signature, including `callback_on_step_end`), so the call is shared. Another pipeline
family plugs in with an entry in PIPELINES.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

from tandem.errors import InvalidRequest
from tandem.video.engine import StepHook
from tandem.video.params import PipelineSpec, ResolvedParams

#: model_index.json `_class_name` -> whether the pipeline takes a first-frame image.
PIPELINES: dict[str, bool] = {
    "WanPipeline": False,
}


def pipeline_class_name(model_dir: str | pathlib.Path) -> str:
    """The `_class_name` of a diffusers directory, checked against PIPELINES.

    Raises:
        InvalidRequest: no model_index.json, or a pipeline class Tandem does not drive.
    """
    index = pathlib.Path(model_dir) / "model_index.json"
    try:
        name = str(json.loads(index.read_text("utf-8")).get("_class_name", ""))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"--model {model_dir} is not a diffusers pipeline directory "
                             f"({exc})", param="model") from None
    if name not in PIPELINES:
        raise InvalidRequest(f"--model {model_dir} holds a {name or 'unnamed'} pipeline; "
                             f"supported: {', '.join(PIPELINES)}", param="model")
    return name


def spec_of(pipe: Any, class_name: str) -> PipelineSpec:
    """Sizes must be multiples of the VAE's spatial stride times the transformer's patch; frame
    counts follow the VAE's temporal stride."""
    patch = pipe.transformer.config.patch_size
    return PipelineSpec(size_multiple=int(pipe.vae_scale_factor_spatial) * int(patch[1]),
                        temporal_factor=int(pipe.vae_scale_factor_temporal),
                        accepts_image=PIPELINES[class_name])


def run(pipe: Any, params: ResolvedParams, on_step: StepHook) -> Any:
    """One generation: frames as uint8 RGB (num_frames, height, width, 3), numpy, on the host.

    The noise comes from a CPU generator seeded with `params.seed`, so a seed means the same
    noise on every device (diffusers' advice for reproducibility).
    """
    import torch

    generator = torch.Generator(device="cpu").manual_seed(params.seed)

    def step_end(_pipe: Any, index: int, _timestep: Any, tensors: dict[str, Any]
                 ) -> dict[str, Any]:
        on_step(index + 1, params.num_inference_steps)
        return tensors

    output = pipe(prompt=params.prompt, negative_prompt=params.negative_prompt or None,
                  height=params.height, width=params.width, num_frames=params.num_frames,
                  num_inference_steps=params.num_inference_steps,
                  guidance_scale=params.guidance_scale, generator=generator,
                  output_type="pt", callback_on_step_end=step_end)
    return frames_to_uint8(output.frames[0])


def frames_to_uint8(frames: Any) -> Any:
    """(num_frames, 3, height, width) float in [0, 1] on the pipeline's device -> uint8
    (num_frames, height, width, 3) numpy.

    Converted where the frames are, so a quarter of the bytes cross to the host and the CPU
    makes no pass over float32 frames. The arithmetic is `mp4.to_uint8`'s on
    diffusers' float32 numpy frames, step for step, so the values are the same.
    """
    import torch

    pixels = (frames.float().clamp(0.0, 1.0) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).contiguous().cpu().numpy()
