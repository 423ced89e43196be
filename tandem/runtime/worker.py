"""Bootstrap of a worker process: engine, KV event log, gRPC server, graceful shutdown.

Which servicers a worker hosts depends on its stage; services/<stage>/ adds them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable

from prometheus_client import start_http_server

from tandem.engines.base import Engine, StepRecord
from tandem.engines.registry import create_engine
from tandem.engines.types import EngineStats, TransferRecord
from tandem.kv.event_log import EventLog
from tandem.model.demo import ensure_demo_model
from tandem.runtime import config as config_lib
from tandem.runtime import logs, tracing
from tandem.runtime.clients import PrefillClients
from tandem.runtime.devices import Device, worker_devices
from tandem.runtime.devices import describe as describe_devices
from tandem.runtime.progress import ProgressWatchdog
from tandem.runtime.served import ServedTally
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.worker_config import WorkerConfig
from tandem.runtime.worker_metrics import WorkerMetrics
from tandem.v1 import kv_events_pb2, worker_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Worker:
    config: WorkerConfig
    engine: Engine
    event_log: EventLog
    service: GrpcService
    #: What it served since it started (its servicers count into it).
    served: ServedTally
    #: The devices it computes on (known once the engine started).
    devices: tuple[Device, ...]


AddServicers = Callable[[Worker], None]


def _transfer_observer(metrics: WorkerMetrics | None,
                       served: ServedTally) -> Callable[[TransferRecord], None]:
    """Each KV read counted as served, as a latency observation and a span (in its request's
    trace)."""
    def observe(record: TransferRecord) -> None:
        served.transfer_ended(record)
        if metrics is not None:
            metrics.observe_transfer(record)
        tracing.record("kv_transfer", record.start_unix_ns,
                       record.start_unix_ns + int(record.duration_s * 1e9),
                       {"tandem.kv.source_worker": record.source_worker_id,
                        "tandem.kv.bytes": record.num_bytes}, record.error)
    return observe


def _trace_step(record: StepRecord) -> None:
    """Each engine step as a span of its own (a trace per step): where a request's time to
    first token went, next to its own spans."""
    tracing.record("engine.step", record.start_unix_ns, record.end_unix_ns, {
        "tandem.step.scheduled": record.num_scheduled,
        "tandem.step.prefill_tokens": record.num_prefill_tokens,
        "tandem.step.admitted": record.num_admitted,
        "tandem.step.first_tokens": record.num_first_tokens,
        "tandem.step.waiting": record.num_waiting,
        "tandem.step.running": record.num_running,
        "tandem.step.launched_ahead": record.launched_ahead})


def _install_debug_hooks(engine: Engine) -> None:
    """--debug-hooks: signals that make the engine stuck and unstuck, for fault tests."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, engine.pause_steps)
    loop.add_signal_handler(signal.SIGUSR2, engine.resume_steps)
    log.warning("debug hooks on: SIGUSR1 pauses the engine's step loop, SIGUSR2 resumes it")


async def run_worker(config: WorkerConfig, stage: str, add_servicers: AddServicers,
                     service_names: list[str]) -> None:
    """Builds the engine and server for `stage`, serves until SIGTERM, then drains."""
    logs.setup(stage, config.log_level, config.log_format, instance=str(config.port))
    tracing.setup(stage)
    if not config.engine_args.model:
        demo = ensure_demo_model()
        config = dataclasses.replace(
            config, engine_args=dataclasses.replace(config.engine_args, model=str(demo)))
    logs.log_config(log, config_lib.as_dict(config), stage=stage)
    engine = create_engine(config.engine, config.engine_args)
    event_log = EventLog(config.kv_event_buffer)
    if config.publish_kv_events:
        # Before start: TensorRT-LLM sizes its event buffer when the engine is built.
        engine.set_event_sink(event_log.append)
    await engine.start()
    if config.disaggregation_mode in ("prefill", "decode"):
        engine.prepare_kv_transfer()
    devices = worker_devices()  # after start: the engine initialised CUDA if it uses it
    log.debug("devices", extra={"devices": describe_devices(devices)})
    served = ServedTally()
    metrics: WorkerMetrics | None = None
    if config.metrics_port:
        loop = asyncio.get_running_loop()

        async def snapshot() -> EngineStats:
            return engine.stats()

        def stats_on_loop() -> EngineStats:
            # Scrapes come on the HTTP server's thread; the engine's state belongs to the loop.
            return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout=5)

        # `served` needs no hop to the loop: each change makes a new whole snapshot.
        metrics = WorkerMetrics(config.identity, stats_on_loop, stage, served.snapshot)
        served.on_hold_end = metrics.observe_hold
        start_http_server(config.metrics_port, config.host, registry=metrics.registry)
    engine.set_transfer_observer(_transfer_observer(metrics, served))
    if tracing.is_enabled():
        engine.set_step_observer(_trace_step)
    # Decode side of disaggregation: leases on prefill workers are released once read.
    prefill_clients = PrefillClients(config.tls)
    engine.set_lease_releaser(prefill_clients.release)
    names = [*service_names, worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name]
    if config.publish_kv_events:
        names.append(kv_events_pb2.DESCRIPTOR.services_by_name["KvEvents"].full_name)
    service = GrpcService(ServerOptions(config.host, config.port, config.grace_period_s,
                                        config.max_message_bytes, config.tls), names)
    worker = Worker(config, engine, event_log, service, served, devices)
    add_servicers(worker)
    watchdog = ProgressWatchdog(engine, config.watchdog, service.set_serving,
                                lambda: not service.draining.active)
    watchdog.start()
    if config.debug_hooks:
        _install_debug_hooks(engine)
    service.on_close(watchdog.close)  # before the engine: a closed engine is not a stuck one
    service.on_close(engine.close)
    service.on_close(served.close)
    service.on_close(prefill_clients.close)
    await service.run()
