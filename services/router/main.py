"""`tandem serve router`: pools, SLA grid, worker policies, and a watcher per worker."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from prometheus_client import start_http_server

from services.router.servicer import RouterServicer
from services.router.watcher import WorkerWatcher
from tandem.errors import InvalidRequest
from tandem.routing.config import PoolConfig, RouterConfig
from tandem.routing.grid import GridConfig
from tandem.routing.metrics import RouterMetrics
from tandem.routing.router import Router
from tandem.routing.workers import WorkerState
from tandem.runtime import build_info, dns, logs, loop, tracing
from tandem.runtime import config as config_lib
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.tls import TlsConfig
from tandem.v1 import router_pb2_grpc

log = logging.getLogger(__name__)


def build_router(config: RouterConfig) -> Router:
    pools = config.resolved_pools()
    if not any(p.workers or p.dns for p in pools):
        raise InvalidRequest("the router needs workers: --decode-workers, or pools in --config",
                             param="pools")
    grid = GridConfig.from_file(config.grid_config) if config.grid_config else None
    return Router(pools, grid, config.block_size, config.typical_osl)


class Membership:
    """One watcher per worker; DNS pools re-resolved every `refresh_s`."""

    def __init__(self, router: Router, refresh_s: float,
                 on_change: Callable[[], None], tls: TlsConfig | None = None) -> None:
        self.router = router
        self.tls = tls
        self.refresh_s = refresh_s
        self.on_change = on_change
        self.watchers: dict[str, WorkerWatcher] = {}

    def _watch(self, workers: Sequence[WorkerState]) -> None:
        for state in workers:
            watcher = WorkerWatcher(state, self.router.index, self.on_change, self.tls)
            self.watchers[state.worker_id] = watcher
            watcher.start()

    async def run_dns(self, pool: PoolConfig) -> None:
        while True:
            try:
                addresses = await dns.resolve(pool.dns)
            except OSError as exc:
                log.warning("DNS resolution failed", extra={"dns": pool.dns, "error": str(exc)})
            else:
                self._watch(self.router.set_pool_workers(pool.name, addresses))
                for gone in [w for w in self.watchers if w not in
                             {s.worker_id for s in self.router.all_workers()}]:
                    await self.watchers.pop(gone).close()
            await asyncio.sleep(self.refresh_s)

    def start(self, pools: Sequence[PoolConfig]) -> list[asyncio.Task[None]]:
        for state in self.router.all_workers():
            state.healthy = False  # until its health and event stream say otherwise
        self._watch(self.router.all_workers())
        return [asyncio.create_task(self.run_dns(p)) for p in pools if p.dns]

    def is_settled(self) -> bool:
        """Whether every worker's index entry is rebuilt (or its worker cannot deliver now)."""
        return all(w.is_settled for w in list(self.watchers.values()))

    async def close(self) -> None:
        for watcher in self.watchers.values():
            await watcher.close()


class Readiness:
    """A (re)started router decides only once its prefix index is rebuilt from every worker's
    event stream, or `timeout_s` after start, whichever comes first; then for good."""

    def __init__(self, membership: Membership, timeout_s: float) -> None:
        self.membership = membership
        self.deadline = time.monotonic() + timeout_s
        self._ready = False

    def __call__(self) -> bool:
        if not self._ready and (self.membership.is_settled()
                                or time.monotonic() >= self.deadline):
            self._ready = True
            log.info("router ready: its prefix index holds every worker's replayed cache",
                     extra={"indexed_blocks": self.membership.router.index.num_blocks,
                            "workers": len(self.membership.watchers)})
        return self._ready


async def serve(config: RouterConfig) -> None:
    logs.setup("router", config.log_level, config.log_format)
    tracing.setup("router")
    logs.log_config(log, config_lib.as_dict(config))
    router = build_router(config)
    service = GrpcService(ServerOptions(config.host, config.port, config.grace_period_s,
                                        config.max_message_bytes, config.tls),
                          ["tandem.v1.Router"])
    metrics = RouterMetrics()
    build_info.register(metrics.registry, "router")
    metrics.watch_index(lambda: {w.worker_id: (router.index.num_blocks_of(w.worker_id),
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
        task = asyncio.get_running_loop().create_task(service.set_serving(serving))
        health_updates.add(task)
        task.add_done_callback(health_updates.discard)

    # NOT_SERVING until the first worker is healthy (set before any watcher can report).
    service.serve_when_started = False
    await service.set_serving(False)
    membership = Membership(router, config.dns_refresh_s, on_change, config.tls)
    ready = Readiness(membership, config.startup_sync_timeout_s)
    router_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(router, config.typical_osl, metrics, ready), service.server)
    dns_tasks = membership.start(config.resolved_pools())
    # Past the deadline the router serves whatever its index holds by then.
    asyncio.get_running_loop().call_later(config.startup_sync_timeout_s, on_change)

    async def close() -> None:
        for task in dns_tasks:
            task.cancel()
        await membership.close()

    service.on_close(close)
    await service.run()


def main(argv: Sequence[str]) -> None:
    config = config_lib.load(RouterConfig, argv, prog="tandem serve router",
                             description="Run the Tandem router.")
    loop.run(serve(config))
