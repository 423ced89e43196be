"""`tandem serve planner`: sizes pools to their SLA targets every interval (tandem.planner.loop)
and acts through a connector. Its gRPC port serves health (SERVING while it plans) and
reflection only; its metrics port the desired and actual workers per pool.

Killing it changes nothing about serving: the deployment keeps its size, and a restarted
planner takes it as it finds it."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import start_http_server

from tandem.errors import InvalidRequest
from tandem.planner.connector import Connector
from tandem.planner.local import LocalConnector
from tandem.planner.loop import PlannerLoop
from tandem.planner.metrics import PlannerMetrics
from tandem.planner.report import ReportWriter
from tandem.planner.scrape import Scraper
from tandem.planner.service_config import PlannerServiceConfig, load_models
from tandem.runtime import build_info, logs, loop
from tandem.runtime import config as config_lib
from tandem.runtime.server import GrpcService, ServerOptions

log = logging.getLogger(__name__)

async def _local(config: PlannerServiceConfig) -> Connector:
    return LocalConnector(config.launcher_address)


async def _kubernetes(config: PlannerServiceConfig) -> Connector:
    from tandem.planner import k8s  # the optional extra tandem[k8s]: imported only when asked

    return await k8s.create_connector(config)


async def _kubernetes_read_only(config: PlannerServiceConfig) -> Connector:
    from tandem.planner import k8s

    return await k8s.create_read_only_connector(config)


#: Connectors by name (--connector), each made from the config (asynchronously: a cluster's
#: client reads its credentials): `tandem up`'s control API (local); a cluster's Deployments
#: (kubernetes), or only their counts read while an HPA or KEDA sets them
#: (kubernetes-read-only; deploy/README.md).
CONNECTORS: dict[str, Callable[[PlannerServiceConfig], Awaitable[Connector]]] = {
    "local": _local,
    "kubernetes": _kubernetes,
    "kubernetes-read-only": _kubernetes_read_only,
}


async def create_connector(config: PlannerServiceConfig) -> Connector:
    """Raises InvalidRequest naming the known connectors for an unknown one."""
    make = CONNECTORS.get(config.connector)
    if make is None:
        raise InvalidRequest(f"connector must be one of {', '.join(CONNECTORS)}, got "
                             f"{config.connector!r}", param="connector")
    return await make(config)


async def serve(config: PlannerServiceConfig) -> None:
    logs.setup("planner", config.log_level, config.log_format)
    logs.log_config(log, config_lib.as_dict(config))
    config.check()
    models = load_models(config.plan)
    metrics = PlannerMetrics()
    build_info.register(metrics.registry, "planner")
    if config.metrics_port:
        start_http_server(config.metrics_port, config.host, registry=metrics.registry)
    connector = await create_connector(config)
    scraper = Scraper([*config.frontend_metrics_urls, *config.router_metrics_urls,
                       *config.worker_metrics_urls], config.scrape_timeout_s)
    report = (ReportWriter(config.status_file, config.plan.interval_s)
              if config.status_file else None)
    planner = PlannerLoop(config.plan, models, connector, scraper, config.frontend_metrics_urls,
                          metrics, report, config.model or None)
    service = GrpcService(ServerOptions(config.host, config.port, config.grace_period_s,
                                        tls=config.tls),
                          service_names=[])
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    def on_done(task: asyncio.Task[None]) -> None:
        # A loop that dies unexpectedly stops the process (its supervisor restarts it) rather
        # than leaving a planner that reports SERVING and plans nothing.
        if not task.cancelled() and task.exception() is not None:
            service.request_stop()

    async def begin() -> None:
        task = asyncio.get_running_loop().create_task(planner.run(stop))
        task.add_done_callback(on_done)
        tasks.append(task)

    async def close() -> None:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await scraper.close()
        await connector.close()

    service.on_start(begin)
    service.on_close(close)
    log.info("planning", extra={"pools": [p.name for p in config.plan.pools],
                                "interval_s": config.plan.interval_s,
                                "gpu_budget": config.plan.gpu_budget,
                                "connector": config.connector})
    await service.run()
    for task in tasks:
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc


def main(argv: Sequence[str]) -> None:
    config = config_lib.load(PlannerServiceConfig, argv, prog="tandem serve planner",
                             description="Run the Tandem planner: pools sized to their SLA.")
    loop.run(serve(config))
