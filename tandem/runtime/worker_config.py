"""Typed config of a worker process (prefill, decode, encode). Flags follow Dynamo's TensorRT-LLM
worker where one exists."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engines.args import EngineArgs


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 9200
    #: Stable identity in KV events and routing; default "host:port".
    worker_id: str = ""
    #: Engine backend by registry name (mock, ...).
    engine: str = "mock"
    #: agg (prefill locally, decode), prefill, decode or encode.
    disaggregation_mode: str = "agg"
    #: Model name clients use; default: the model directory's name.
    served_model_name: str = ""
    publish_kv_events: bool = True
    #: Event batches kept for subscribers that reconnect.
    kv_event_buffer: int = 10000
    #: Most frequent load report on the KvEvents stream, milliseconds.
    load_interval_ms: int = 100
    #: Seconds in-flight requests get to finish after SIGTERM.
    grace_period_s: float = 30.0
    log_level: str = "info"
    engine_args: EngineArgs = field(default_factory=EngineArgs)

    @property
    def identity(self) -> str:
        return self.worker_id or f"{self.host}:{self.port}"
