"""`tandem serve <prefill|decode|encode|embed>`: one worker process of the given stage."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.kv_events import KvEventsServicer
from services.common.worker_stats import WorkerServicer
from services.decode.servicer import DecodeServicer
from services.decode.session_socket import SessionSocket
from services.embed.servicer import EmbedServicer
from services.encode.servicer import EncodeServicer
from services.prefill.servicer import PrefillServicer
from tandem.errors import InvalidRequest
from tandem.runtime import config as config_lib
from tandem.runtime import loop, unix_sockets
from tandem.runtime.worker import Worker, run_worker
from tandem.runtime.worker_config import WorkerConfig
from tandem.v1 import (
    decode_pb2_grpc,
    embed_pb2_grpc,
    encode_pb2_grpc,
    kv_events_pb2_grpc,
    prefill_pb2_grpc,
    worker_pb2_grpc,
)


@dataclass(frozen=True)
class Stage:
    service_name: str
    register: Callable[[Worker], None]
    #: --disaggregation-mode values this stage runs in; the first is its default.
    modes: tuple[str, ...]


def _decode(w: Worker) -> None:
    servicer = DecodeServicer(w.engine, w.service.draining, w.config.session_interval_ms / 1000)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, w.service.server)
    path = unix_sockets.session_server_path(w.config.host, w.service.port)
    if path is not None and w.service.unix_path is not None:  # where gRPC has a socket too
        sessions = SessionSocket(path, servicer.session)
        w.service.on_start(sessions.start)
        w.service.on_close(sessions.close)  # after the drain, before the engine's close


def _prefill(w: Worker) -> None:
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(w.engine, w.service.draining, w.config.kv_lease_ms, w.config.identity,
                        w.served), w.service.server)


def _encode(w: Worker) -> None:
    encode_pb2_grpc.add_EncodeServicer_to_server(
        EncodeServicer(w.engine, w.service.draining), w.service.server)


def _embed(w: Worker) -> None:
    embed_pb2_grpc.add_EmbedServicer_to_server(
        EmbedServicer(w.engine, w.service.draining), w.service.server)


STAGES: dict[str, Stage] = {
    "decode": Stage("tandem.v1.Decode", _decode, ("agg", "decode")),
    "prefill": Stage("tandem.v1.Prefill", _prefill, ("prefill",)),
    "encode": Stage("tandem.v1.Encode", _encode, ("encode",)),
    "embed": Stage("tandem.v1.Embed", _embed, ("embed",)),
}


def _registration(stage: Stage) -> Callable[[Worker], None]:
    def register(worker: Worker) -> None:
        stage.register(worker)
        worker_pb2_grpc.add_WorkerServicer_to_server(
            WorkerServicer(worker.config.identity, worker.engine, worker.config.debug_hooks,
                           worker.served.snapshot, worker.devices), worker.service.server)
        if worker.config.publish_kv_events:
            kv_events_pb2_grpc.add_KvEventsServicer_to_server(KvEventsServicer(
                worker.config.identity, worker.engine, worker.event_log,
                worker.config.load_interval_ms, worker.service.draining,
                worker.config.kv_events_batch_ms, worker.served.snapshot, worker.devices),
                worker.service.server)
    return register


def _with_stage_mode(config: WorkerConfig, stage: str, spec: Stage) -> WorkerConfig:
    if config.disaggregation_mode == "agg" and "agg" not in spec.modes:
        return dataclasses.replace(config, disaggregation_mode=spec.modes[0])
    if config.disaggregation_mode not in spec.modes:
        raise InvalidRequest(f"a {stage} worker runs in --disaggregation-mode "
                             f"{' or '.join(spec.modes)}, not '{config.disaggregation_mode}'",
                             param="disaggregation_mode")
    return config


def main(stage: str, argv: Sequence[str]) -> None:
    config = config_lib.load(WorkerConfig, argv, prog=f"tandem serve {stage}",
                             description=f"Run a Tandem {stage} worker.")
    spec = STAGES[stage]
    config = _with_stage_mode(config, stage, spec)
    if config.disaggregation_mode == "encode":
        config = dataclasses.replace(config, engine_args=dataclasses.replace(
            config.engine_args, encode_only=True))
    elif config.disaggregation_mode == "embed":
        config = dataclasses.replace(config, engine_args=dataclasses.replace(
            config.engine_args, embed_only=True))
    loop.run(run_worker(config, stage, _registration(spec), [spec.service_name]))
