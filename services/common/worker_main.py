"""`tandem serve <prefill|decode|encode>`: one worker process of the given stage."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.kv_events import KvEventsServicer
from services.decode.servicer import DecodeServicer
from services.encode.servicer import EncodeServicer
from services.prefill.servicer import PrefillServicer
from tandem.runtime import config as config_lib
from tandem.runtime import loop
from tandem.runtime.worker import Worker, run_worker
from tandem.runtime.worker_config import WorkerConfig
from tandem.v1 import decode_pb2_grpc, encode_pb2_grpc, kv_events_pb2_grpc, prefill_pb2_grpc


@dataclass(frozen=True)
class Stage:
    service_name: str
    register: Callable[[Worker], None]


def _decode(w: Worker) -> None:
    decode_pb2_grpc.add_DecodeServicer_to_server(
        DecodeServicer(w.engine, w.service.draining), w.service.server)


def _prefill(w: Worker) -> None:
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(w.engine, w.service.draining), w.service.server)


def _encode(w: Worker) -> None:
    encode_pb2_grpc.add_EncodeServicer_to_server(
        EncodeServicer(w.engine, w.service.draining), w.service.server)


STAGES: dict[str, Stage] = {
    "decode": Stage("tandem.v1.Decode", _decode),
    "prefill": Stage("tandem.v1.Prefill", _prefill),
    "encode": Stage("tandem.v1.Encode", _encode),
}


def _registration(stage: Stage) -> Callable[[Worker], None]:
    def register(worker: Worker) -> None:
        stage.register(worker)
        if worker.config.publish_kv_events:
            kv_events_pb2_grpc.add_KvEventsServicer_to_server(KvEventsServicer(
                worker.config.identity, worker.engine, worker.event_log,
                worker.config.load_interval_ms, worker.service.draining), worker.service.server)
    return register


def main(stage: str, argv: Sequence[str]) -> None:
    config = config_lib.load(WorkerConfig, argv, prog=f"tandem serve {stage}",
                             description=f"Run a Tandem {stage} worker.")
    spec = STAGES[stage]
    loop.run(run_worker(config, stage, _registration(spec), [spec.service_name]))
