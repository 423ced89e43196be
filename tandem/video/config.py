"""Typed config of a video worker (`tandem serve video`). Engine option names follow Dynamo's
TensorRT-LLM diffusion worker (components/src/dynamo/trtllm/backend_args.py, "Diffusion
Options"): --attn-type, --linear-type, --torch-compile-mode, --enable-async-cpu-offload."""
from __future__ import annotations

import socket
from dataclasses import dataclass, field

from tandem.errors import InvalidRequest
from tandem.runtime.progress import WatchdogConfig
from tandem.runtime.tls import TlsConfig
from tandem.video.params import VideoLimits

DTYPES = ("auto", "float32", "float16", "bfloat16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
#: visual_gen's attention and linear kernels (Dynamo's --attn-type / --linear-type choices).
ATTN_TYPES = ("default", "sage-attn", "sparse-videogen", "sparse-videogen2")
LINEAR_TYPES = ("default", "trtllm-fp8-blockwise", "trtllm-fp8-per-tensor", "trtllm-nvfp4")


@dataclass(frozen=True)
class VideoEngineArgs:
    # == model and engine ==
    #: Diffusers pipeline directory (model_index.json and one folder per component); unset:
    #: a tiny random-weight Wan 2.1 pipeline generated on first use (tests, demos).
    model: str = ""
    #: auto (CUDA when available), cpu, cuda or cuda:N.
    device: str = "auto"
    #: auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16. The VAE always
    #: decodes in float32, as Wan's reference code does.
    dtype: str = "auto"
    #: Compile the transformer with torch.compile (Dynamo's --disable-torch-compile, inverted:
    #: off by default here, since compiling takes minutes and CPU runs rarely gain).
    enable_torch_compile: bool = False
    #: torch.compile mode: default, reduce-overhead or max-autotune.
    torch_compile_mode: str = "default"
    #: Keep the pipeline's models in CPU memory and move each to the GPU only while it runs
    #: (reference: diffusers' model CPU offload; trtllm: visual_gen's async offload).
    enable_async_cpu_offload: bool = False
    #: trtllm: attention kernels (default, sage-attn, sparse-videogen, sparse-videogen2).
    attn_type: str = "default"
    #: trtllm: linear-layer kernels (default, trtllm-fp8-blockwise, trtllm-fp8-per-tensor,
    #: trtllm-nvfp4).
    linear_type: str = "default"

    def __post_init__(self) -> None:
        for name, value, allowed in (("dtype", self.dtype, DTYPES),
                                     ("torch_compile_mode", self.torch_compile_mode,
                                      COMPILE_MODES),
                                     ("attn_type", self.attn_type, ATTN_TYPES),
                                     ("linear_type", self.linear_type, LINEAR_TYPES)):
            if value not in allowed:
                raise InvalidRequest(f"--{name.replace('_', '-')} must be one of "
                                     f"{', '.join(allowed)}, got '{value}'", param=name)


@dataclass(frozen=True)
class VideoWorkerConfig:
    # == network ==
    #: Address the worker's gRPC port binds to (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    #: The worker's gRPC port (Video, KvEvents load reports, health, reflection).
    port: int = 9400
    #: Largest gRPC message the port accepts or sends, bytes (a b64_json video travels in one).
    max_message_bytes: int = 256 * 1024 * 1024
    # == general ==
    #: Stable identity in load reports and routing; unset: host:port.
    worker_id: str = ""
    #: Video engine by registry name: reference (diffusers) or trtllm (TensorRT-LLM visual_gen).
    engine: str = "reference"
    #: Model name clients use; unset: the model directory's name.
    served_model_name: str = ""
    # == general ==
    #: Directory finished MP4s are written to, named by their SHA-256; nothing is written or
    #: read outside it. Share it between replicas to serve any replica's videos.
    media_output_dir: str = "/tmp/tandem_media"
    #: Largest MP4 kept, bytes; a larger result fails its job.
    max_video_bytes: int = 256 * 1024 * 1024
    # == batching and scheduling ==
    #: Jobs accepted but not yet running; past it new requests get RESOURCE_EXHAUSTED (one job
    #: runs at a time: run one worker per GPU).
    max_queued_videos: int = 8
    #: Seconds a finished job stays in the table (GetJob, ReadVideo); its file stays longer.
    job_ttl_s: float = 3600.0
    #: Most finished jobs remembered; the oldest go first.
    max_finished_jobs: int = 1000
    #: Most frequent load report on the KvEvents stream, milliseconds.
    load_interval_ms: int = 100
    #: Defaults and bounds of request parameters (--default-width, --max-num-frames, ...).
    limits: VideoLimits = field(default_factory=VideoLimits)
    # == reliability ==
    #: Seconds accepted jobs get to finish after SIGTERM; then the rest are cancelled.
    grace_period_s: float = 30.0
    #: Health that proves progress (--progress-timeout-s, ...): NOT_SERVING while a job is
    #: queued or running and no denoising step started for that long.
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    # == observability ==
    #: Port of the Prometheus /metrics endpoint; 0: none.
    metrics_port: int = 0
    #: Least severe log level written: debug, info, warning or error.
    log_level: str = "info"
    #: Log format: text, json or auto (text on a terminal, else json).
    log_format: str = "auto"
    # == testing ==
    #: Fault-test hooks: SIGUSR1 pauses the denoising loop before its next step, SIGUSR2
    #: resumes it. Never in production.
    debug_hooks: bool = False
    # == security ==
    #: TLS/mTLS on the worker's port (--tls-*).
    tls: TlsConfig = field(default_factory=TlsConfig)
    #: Engine flags (model, device, dtype, compile, offload, kernels).
    engine_args: VideoEngineArgs = field(default_factory=VideoEngineArgs)

    @property
    def identity(self) -> str:
        if self.worker_id:
            return self.worker_id
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{self.port}"
