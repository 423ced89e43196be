"""`tandem serve video`: one video worker process (a diffusion engine behind the Video API)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import signal
from collections.abc import Sequence

from prometheus_client import start_http_server

from services.video.load import VideoLoadServicer
from services.video.servicer import VideoServicer
from tandem.model.tiny_wan import ensure_tiny_wan
from tandem.runtime import build_info, logs, loop, tracing
from tandem.runtime import config as config_lib
from tandem.runtime.progress import ProgressWatchdog
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.v1 import kv_events_pb2, kv_events_pb2_grpc, video_pb2, video_pb2_grpc
from tandem.video.config import VideoWorkerConfig
from tandem.video.engine import create_video_engine
from tandem.video.metrics import VideoWorkerMetrics
from tandem.video.runner import RunnerConfig, VideoRunner
from tandem.video.storage import MediaStore

log = logging.getLogger(__name__)


def _install_debug_hooks(runner: VideoRunner) -> None:
    event_loop = asyncio.get_running_loop()
    event_loop.add_signal_handler(signal.SIGUSR1, runner.pause_steps)
    event_loop.add_signal_handler(signal.SIGUSR2, runner.resume_steps)
    log.warning("debug hooks on: SIGUSR1 pauses the denoising loop, SIGUSR2 resumes it")


async def run_video_worker(config: VideoWorkerConfig) -> None:
    """Loads the pipeline, serves until SIGTERM, then lets accepted jobs finish (grace)."""
    logs.setup("video", config.log_level, config.log_format, instance=str(config.port))
    tracing.setup("video")
    if not config.engine_args.model:
        config = dataclasses.replace(config, engine_args=dataclasses.replace(
            config.engine_args, model=str(ensure_tiny_wan())))
    logs.log_config(log, config_lib.as_dict(config), stage="video")
    model = config.served_model_name or pathlib.Path(config.engine_args.model).name
    engine = create_video_engine(config.engine, config.engine_args)
    store = MediaStore(config.media_output_dir, config.max_video_bytes)
    runner_config = RunnerConfig(model, config.limits, config.max_queued_videos,
                                 config.job_ttl_s, config.max_finished_jobs)
    runner = VideoRunner(engine, store, runner_config)
    if config.metrics_port:
        metrics = VideoWorkerMetrics(config.identity, runner.stats)
        runner.observer = metrics.observe
        build_info.register(metrics.registry, "video")
        start_http_server(config.metrics_port, config.host, registry=metrics.registry)
    await runner.start()
    names = [video_pb2.DESCRIPTOR.services_by_name["Video"].full_name,
             kv_events_pb2.DESCRIPTOR.services_by_name["KvEvents"].full_name]
    service = GrpcService(ServerOptions(config.host, config.port, config.grace_period_s,
                                        config.max_message_bytes, config.tls), names)
    video_pb2_grpc.add_VideoServicer_to_server(VideoServicer(runner, store), service.server)
    kv_events_pb2_grpc.add_KvEventsServicer_to_server(VideoLoadServicer(
        config.identity, runner, config.load_interval_ms, service.draining), service.server)
    watchdog = ProgressWatchdog(runner, config.watchdog, service.set_serving,
                                lambda: not service.draining.active)
    watchdog.start()
    if config.debug_hooks:
        _install_debug_hooks(runner)
    service.on_drain(lambda: runner.drain(config.grace_period_s))
    service.on_close(watchdog.close)
    service.on_close(runner.close)
    log.info("video worker ready", extra={"model": model, "engine": config.engine,
                                          "media_output_dir": str(store.root)})
    await service.run()


def main(stage: str, argv: Sequence[str]) -> None:
    config = config_lib.load(VideoWorkerConfig, argv, prog="tandem serve video",
                             description="Run a Tandem video worker (text-to-video diffusion).")
    loop.run(run_video_worker(config))
