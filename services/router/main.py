"""`tandem serve router`: pools, SLA grid, worker policies, and a watcher per worker.

SIGHUP re-reads the config (file, environment and flags, as at start) and takes the static
pools' new members: `tandem up` rewrites its routers' config file and signals them when its
planner adds or removes workers (tandem.launcher.scaling), as Kubernetes pools change through
DNS. A restarted router reads the same file, so it starts with the current members.
"""
from __future__ import annotations

import asyncio
import logging
import pathlib
import signal
from collections.abc import Callable, Sequence

from prometheus_client import start_http_server

from services.router.servicer import RouterServicer
from tandem.errors import InvalidRequest, TandemError
from tandem.routing.config import RouterConfig
from tandem.routing.grid_config import read_grid_config_file
from tandem.routing.membership import Membership, Readiness
from tandem.routing.metrics import RouterMetrics
from tandem.routing.router import Router
from tandem.runtime import build_info, logs, loop, tracing
from tandem.runtime import config as config_lib
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.tasks import spawn
from tandem.v1 import router_pb2_grpc

log = logging.getLogger(__name__)


def build_router(config: RouterConfig) -> Router:
    pools = config.resolved_pools()
    if not any(p.workers or p.dns for p in pools):
        raise InvalidRequest("the router needs workers: --decode-workers, or pools in --config",
                             param="pools")
    grid = read_grid_config_file(config.grid_config) if config.grid_config else None
    return Router(pools, grid, config.block_size, config.typical_osl)


def grid_config_text(config: RouterConfig) -> str:
    """The SLA grid file's JSON as read (build_router validated it); "" without one."""
    return pathlib.Path(config.grid_config).read_text() if config.grid_config else ""


async def serve(config: RouterConfig,
                reread: Callable[[], RouterConfig] | None = None) -> None:
    """Runs the router until SIGTERM. `reread` gives the config anew (on SIGHUP)."""
    logs.setup("router", config.log_level, config.log_format)
    tracing.setup("router")
    logs.log_config(log, config_lib.as_dict(config))
    router = build_router(config)
    service = GrpcService(ServerOptions(config.host, config.port, config.grace_period_s,
                                        config.max_message_bytes, config.tls),
                          ["tandem.v1.Router"])
    metrics = RouterMetrics()
    build_info.register(metrics.registry, "router")
    metrics.watch_index(lambda: {w.worker_id: (w.ref.pool,
                                               router.index.num_blocks_of(w.worker_id),
                                               w.active_requests)
                                 for w in router.all_workers()})
    if config.metrics_port:
        start_http_server(config.metrics_port, config.host, registry=metrics.registry)
    health_updates: set[asyncio.Task[None]] = set()

    def on_change() -> None:
        # The router serves only once its index is rebuilt and while some worker can take a
        # request: `tandem up`, orchestrators and frontends then never send traffic to a
        # router that would answer UNAVAILABLE or route blind to the workers' caches.
        serving = ready() and router.can_serve()
        for pool in router.pools:
            metrics.healthy_workers.labels(pool.name).set(
                sum(w.healthy for w in pool.workers.values()))
        if service.draining.active:
            return
        spawn(service.set_serving(serving), health_updates)

    # NOT_SERVING until the first worker is healthy (set before any watcher can report).
    service.serve_when_started = False
    await service.set_serving(False)
    membership = Membership(router, config.dns_refresh_s, on_change, config.tls)
    ready = Readiness(membership, config.startup_sync_timeout_s)
    router_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(router, config.typical_osl, metrics, ready, grid_config_text(config)),
        service.server)
    dns_tasks = membership.start(config.resolved_pools())
    if reread is not None:
        _reload_on_hangup(membership, reread)
    # Past the deadline the router serves whatever its index holds by then.
    asyncio.get_running_loop().call_later(config.startup_sync_timeout_s, on_change)

    async def close() -> None:
        for task in dns_tasks:
            task.cancel()
        await membership.close()

    service.on_close(close)
    await service.run()


def _reload_on_hangup(membership: Membership, reread: Callable[[], RouterConfig]) -> None:
    """SIGHUP: the static pools' members as the config says now (module docstring). Taken once
    more right away: a launcher that rewrote the file after this router read it, but before
    this handler existed, signalled a process that ignored it (`tandem up` starts its
    children with SIGHUP ignored, so that such a signal cannot kill one)."""
    reloads: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        try:
            pools = reread().resolved_pools()
        except (OSError, TandemError) as exc:
            log.warning("config not re-read; members unchanged", extra={"error": str(exc)})
            return
        await membership.take_static_members(pools)

    def on_hangup() -> None:
        spawn(reload(), reloads)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hangup)
    on_hangup()


def main(argv: Sequence[str]) -> None:
    def read() -> RouterConfig:
        return config_lib.load(RouterConfig, argv, prog="tandem serve router",
                               description="Run the Tandem router.")

    loop.run(serve(read(), read))
