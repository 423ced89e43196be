"""Video generation parameters: as a caller gives them (absent = default), the limits a worker
enforces, and the resolved values a job runs with.

Errors name the field in the public API's words (OpenAI's and Dynamo's /v1/videos: `size`,
`num_frames`, `seconds`, ...), so that the worker's INVALID_ARGUMENT reaches an HTTP client as a
400 whose `param` is the field it sent.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from tandem.errors import InvalidRequest

MAX_SEED = 2**63 - 1
MAX_FPS = 120
MAX_GUIDANCE_SCALE = 50.0


@dataclass(frozen=True)
class PipelineSpec:
    """What a model can produce: frame sizes are multiples of `size_multiple` (VAE stride x
    transformer patch), frame counts are `temporal_factor` * k + 1 (the VAE's causal time
    compression keeps the first frame alone)."""

    size_multiple: int = 16
    temporal_factor: int = 4
    #: The pipeline takes a first-frame image (image-to-video).
    accepts_image: bool = False

    def is_valid_frame_count(self, n: int) -> bool:
        return n >= 1 and (n - 1) % self.temporal_factor == 0

    def nearest_frame_count(self, n: int) -> int:
        k = max(round((n - 1) / self.temporal_factor), 0)
        return k * self.temporal_factor + 1


@dataclass(frozen=True)
class VideoLimits:
    """A worker's defaults and bounds (flag names after Dynamo's diffusion options)."""

    #: Frame width when a request gives none, pixels.
    default_width: int = 832
    #: Frame height when a request gives none, pixels.
    default_height: int = 480
    #: Frames when a request gives neither num_frames nor seconds.
    default_num_frames: int = 81
    #: Frames per second of the MP4 when a request gives none.
    default_fps: int = 16
    #: Denoising steps when a request gives none.
    default_num_inference_steps: int = 50
    #: Classifier-free guidance scale when a request gives none.
    default_guidance_scale: float = 5.0
    #: Widest frame accepted, pixels.
    max_width: int = 1280
    #: Tallest frame accepted, pixels.
    max_height: int = 1280
    #: Most frames in one video.
    max_num_frames: int = 129
    #: Most denoising steps in one request.
    max_num_inference_steps: int = 100
    #: Longest prompt (and negative prompt), characters.
    max_prompt_chars: int = 4096
    #: Largest first-frame image, bytes.
    max_image_bytes: int = 10 * 1024 * 1024


@dataclass(frozen=True)
class VideoRequestParams:
    """A request's parameters; None: the worker's default."""

    prompt: str
    negative_prompt: str = ""
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    seconds: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    input_image: bytes = b""


@dataclass(frozen=True)
class ResolvedParams:
    """Every value a generation runs with."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    input_image: bytes = b""

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps


def _positive(value: int | None, default: int, param: str, upper: int) -> int:
    resolved = default if value is None else value
    if not 1 <= resolved <= upper:
        raise InvalidRequest(f"{param} must be between 1 and {upper}, got {resolved}",
                             param=param)
    return resolved


def _size(p: VideoRequestParams, limits: VideoLimits, spec: PipelineSpec) -> tuple[int, int]:
    width = limits.default_width if p.width is None else p.width
    height = limits.default_height if p.height is None else p.height
    for name, value, upper in (("width", width, limits.max_width),
                               ("height", height, limits.max_height)):
        if not 1 <= value <= upper:
            raise InvalidRequest(f"size: {name} must be between 1 and {upper} pixels, got "
                                 f"{value}", param="size")
        if value % spec.size_multiple:
            raise InvalidRequest(f"size: {name} {value} is not a multiple of "
                                 f"{spec.size_multiple}, which this model needs", param="size")
    return width, height


def _frames(p: VideoRequestParams, fps: int, limits: VideoLimits, spec: PipelineSpec) -> int:
    if p.num_frames is not None:
        if not 1 <= p.num_frames <= limits.max_num_frames:
            raise InvalidRequest(f"num_frames must be between 1 and {limits.max_num_frames}, "
                                 f"got {p.num_frames}", param="num_frames")
        if not spec.is_valid_frame_count(p.num_frames):
            raise InvalidRequest(
                f"num_frames {p.num_frames} is not a count this model produces "
                f"({spec.temporal_factor}k+1, e.g. {spec.nearest_frame_count(p.num_frames)})",
                param="num_frames")
        return p.num_frames
    if p.seconds is None:
        return limits.default_num_frames
    # A duration is a wish, not an exact count: round to a count the model produces.
    frames = spec.nearest_frame_count(p.seconds * fps)
    if not 1 <= p.seconds or frames > limits.max_num_frames:
        raise InvalidRequest(f"seconds {p.seconds} at {fps} fps gives {frames} frames; at most "
                             f"{limits.max_num_frames} frames are allowed", param="seconds")
    return frames


def _prompts(p: VideoRequestParams, limits: VideoLimits) -> None:
    if not p.prompt.strip():
        raise InvalidRequest("prompt must not be empty", param="prompt")
    for name, text in (("prompt", p.prompt), ("negative_prompt", p.negative_prompt)):
        if len(text) > limits.max_prompt_chars:
            raise InvalidRequest(f"{name} is longer than {limits.max_prompt_chars} characters",
                                 param=name)


def resolve(p: VideoRequestParams, limits: VideoLimits, spec: PipelineSpec) -> ResolvedParams:
    """Fills in defaults, draws a seed, and checks every value.

    Raises:
        InvalidRequest: a value out of range or one the model cannot produce; `param` names the
            public API field (prompt, size, num_frames, seconds, fps, num_inference_steps,
            guidance_scale, seed, input_reference).
    """
    _prompts(p, limits)
    width, height = _size(p, limits, spec)
    fps = _positive(p.fps, limits.default_fps, "fps", MAX_FPS)
    num_frames = _frames(p, fps, limits, spec)
    steps = _positive(p.num_inference_steps, limits.default_num_inference_steps,
                      "num_inference_steps", limits.max_num_inference_steps)
    guidance = limits.default_guidance_scale if p.guidance_scale is None else p.guidance_scale
    if not 0.0 <= guidance <= MAX_GUIDANCE_SCALE:  # also false for NaN
        raise InvalidRequest(f"guidance_scale must be between 0 and {MAX_GUIDANCE_SCALE:g}, got "
                             f"{guidance}", param="guidance_scale")
    seed = secrets.randbelow(MAX_SEED) if p.seed is None else p.seed
    if not 0 <= seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be between 0 and 2^63-1, got {seed}", param="seed")
    if p.input_image and not spec.accepts_image:
        raise InvalidRequest("this model generates from text only; it takes no "
                             "input_reference image", param="input_reference")
    if len(p.input_image) > limits.max_image_bytes:
        raise InvalidRequest(f"input_reference is larger than {limits.max_image_bytes} bytes",
                             param="input_reference")
    return ResolvedParams(p.prompt, p.negative_prompt, width, height, num_frames, fps, steps,
                          float(guidance), seed, p.input_image)


def as_request(r: ResolvedParams) -> VideoRequestParams:
    """The resolved values as explicit request values (the job reports them this way; the
    input image is not echoed back)."""
    return VideoRequestParams(r.prompt, r.negative_prompt, r.width, r.height, r.num_frames,
                              None, r.fps, r.num_inference_steps, r.guidance_scale, r.seed)
