"""The video engine interface every diffusion backend implements, and the registry that picks
one by name (reference: Hugging Face diffusers; trtllm: TensorRT-LLM's visual_gen).

An engine is blocking by design: the worker's runner calls `load` and `generate` on its own
thread, one generation at a time, so that the event loop keeps serving progress, health and
cancellations while a denoising step runs.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequest
from tandem.video.params import PipelineSpec, ResolvedParams

if TYPE_CHECKING:
    import numpy as np

    from tandem.video.config import VideoEngineArgs

#: Called after each denoising step with (steps done, steps in all). It may raise to stop the
#: generation there (a cancellation): the exception leaves `generate` unchanged.
StepHook = Callable[[int, int], None]


class VideoEngine(ABC):
    """A text-to-video (or image-to-video) diffusion pipeline.

    Contract:
      - `load` runs once, before any `generate`; it may take minutes (weights, compilation).
      - `generate` runs one video whole and returns its frames as uint8 RGB on the host, shape
        (num_frames, height, width, 3) (converted on the pipeline's device: see
        `pipelines.frames_to_uint8`). It calls `on_step` after every denoising step, on the
        calling thread; whatever `on_step` raises ends the generation before the next step
        and propagates. Calls never overlap (a pipeline's scheduler is per-call state).
      - `spec` (valid after `load`) says which sizes and frame counts the model produces.
    """

    #: Registry name of the backend.
    name: str = ""
    #: What `load` found the pipeline produces; None before it ran.
    _spec: PipelineSpec | None = None

    @property
    def spec(self) -> PipelineSpec:
        """Frame-size multiple, frame-count rule, whether an input image is taken."""
        assert self._spec is not None, "load() first"
        return self._spec

    @abstractmethod
    def load(self) -> None:
        """Loads the pipeline onto its device. Raises InvalidRequest for an unusable model."""

    @abstractmethod
    def generate(self, params: ResolvedParams, on_step: StepHook) -> np.ndarray:
        """Runs one generation (see the class contract)."""

    def close(self) -> None:  # noqa: B027  (most backends free memory by being dropped)
        """Releases the pipeline."""


VideoEngineFactory = Callable[["VideoEngineArgs"], VideoEngine]
# name -> "module:factory", imported lazily (torch, diffusers, visual_gen load only when used).
_BACKENDS: dict[str, str] = {
    "reference": "tandem.video.reference:create_reference_video_engine",
    "trtllm": "tandem.video.trtllm:create_trtllm_video_engine",
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_video_engine(name: str, args: VideoEngineArgs) -> VideoEngine:
    """Builds the named backend. Raises InvalidRequest listing the supported names."""
    target = _BACKENDS.get(name)
    if target is None:
        raise InvalidRequest(f"unknown video engine '{name}'; supported: "
                             f"{', '.join(backend_names())}", param="engine")
    module_name, _, attr = target.partition(":")
    factory: VideoEngineFactory = getattr(importlib.import_module(module_name), attr)
    return factory(args)
