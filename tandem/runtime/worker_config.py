"""Typed config of a worker process (prefill, decode, encode). Flags follow Dynamo's TensorRT-LLM
worker where one exists."""
from __future__ import annotations

import socket
from dataclasses import dataclass, field

from tandem.engines.args import EngineArgs
from tandem.errors import InvalidRequest
from tandem.runtime.progress import WatchdogConfig
from tandem.runtime.tls import TlsConfig

DISAGGREGATION_MODES = ("agg", "prefill", "decode", "encode", "embed")


@dataclass(frozen=True)
class WorkerConfig:
    # == network ==
    #: Address the worker's gRPC port binds to (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    #: The worker's gRPC port (its stage's API, Worker, KvEvents, health, reflection).
    port: int = 9200
    #: Largest gRPC message the worker's port accepts or sends, bytes.
    max_message_bytes: int = 64 * 1024 * 1024
    # == general ==
    #: Stable identity in KV events and routing, also the address decode workers release
    #: leases at; unset: host:port (a wildcard host replaced by this machine's address).
    worker_id: str = ""
    #: Engine backend by registry name: reference (PyTorch), mock (simulated timing, no model)
    #: or trtllm (TensorRT-LLM).
    engine: str = "reference"
    # == disaggregation ==
    #: agg (prefill locally, then decode), prefill, decode, encode or embed; `tandem serve <stage>`
    #: sets it from the stage.
    disaggregation_mode: str = "agg"
    #: How long a prefill worker keeps a request's KV blocks for its decode worker to read,
    #: milliseconds; unread leases then expire and their blocks return to the pool.
    kv_lease_ms: int = 30_000
    # == model and engine ==
    #: Model name clients use; unset: the model directory's name.
    served_model_name: str = ""
    # == routing ==
    #: Publish KV block stored/removed events and load on the KvEvents stream (the router's
    #: kv policy and load accounting read it).
    publish_kv_events: bool = True
    #: Event batches kept for subscribers that reconnect, batches.
    kv_event_buffer: int = 10000
    #: Most frequent load report on the KvEvents stream, milliseconds.
    load_interval_ms: int = 100
    #: Shortest time between two Decode.Session batches to one frontend, milliseconds: the
    #: news of the steps within it goes out together, each request's tokens merged. An engine
    #: on a GPU steps slower than this (one batch per step, nothing waits); one that steps
    #: faster (the mock at --speedup-ratio 0, a tiny model) would otherwise cost both processes
    #: a message, and the client an SSE event, per step. 0: a batch per step, however short.
    session_interval_ms: float = 1.0
    #: Most frequent message of KV events on the KvEvents stream, milliseconds: the events of
    #: the steps in that time go out together (a router's index lags by at most this); 0: one
    #: message per engine step.
    kv_events_batch_ms: float = 5.0
    # == reliability ==
    #: Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    grace_period_s: float = 30.0
    #: Health that proves progress (--progress-timeout-s, --canary-interval-s,
    #: --canary-timeout-s): NOT_SERVING while the engine is stuck.
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    # == observability ==
    #: Port of the Prometheus /metrics endpoint; 0: none.
    metrics_port: int = 0
    #: Least severe log level written: debug, info, warning or error.
    log_level: str = "info"
    #: Log format: text (one line per event, for a person), json (one object per line, for
    #: collectors) or auto (text when stderr is a terminal, else json).
    log_format: str = "auto"
    # == testing ==
    #: Fault-test hooks: SIGUSR1 pauses the engine's step loop (a stuck engine), SIGUSR2
    #: resumes it. Never in production.
    debug_hooks: bool = False
    # == security ==
    #: TLS/mTLS on the worker's port and on its channels to prefill workers (--tls-*).
    tls: TlsConfig = field(default_factory=TlsConfig)
    #: Engine flags (sections model and engine, batching and scheduling, KV cache, ...).
    engine_args: EngineArgs = field(default_factory=EngineArgs)

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise InvalidRequest(
                f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                f"got '{self.disaggregation_mode}'", param="disaggregation_mode")

    @property
    def identity(self) -> str:
        """The worker's id, also the address peers reach it at (decode workers release
        prefill leases there): --worker-id, else host:port, with a wildcard host replaced by
        this machine's address (containers, pods)."""
        if self.worker_id:
            return self.worker_id
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{self.port}"
