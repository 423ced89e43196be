"""Who a router follows: one WorkerWatcher (health and KV event stream) per worker of its pools,
DNS pools re-resolved, and when the prefix index is rebuilt enough to decide. The router service
and a frontend's local router (tandem.routing.local) both run one."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from tandem.routing.config import PoolConfig
from tandem.routing.router import Router
from tandem.routing.watcher import WorkerWatcher
from tandem.routing.workers import WorkerState
from tandem.runtime import dns
from tandem.runtime.tls import TlsConfig

log = logging.getLogger(__name__)


class Membership:
    """One watcher per worker; DNS pools re-resolved every `refresh_s`. With `index_all` off,
    only the workers of pools routed by prefix stream their KV events (the others only their
    load): for a router that only decides (a frontend's local router), where the router
    service indexes every worker for its status."""

    def __init__(self, router: Router, refresh_s: float,
                 on_change: Callable[[], None], tls: TlsConfig | None = None,
                 index_all: bool = True) -> None:
        self.router = router
        self.tls = tls
        self.index_all = index_all
        self.refresh_s = refresh_s
        self.on_change = on_change
        self.watchers: dict[str, WorkerWatcher] = {}

    def _watch(self, workers: Sequence[WorkerState]) -> None:
        for state in workers:
            loads_only = not (self.index_all or self.router.routes_by_prefix(state.ref.pool))
            watcher = WorkerWatcher(state, self.router.index, self.on_change, self.tls,
                                    loads_only)
            self.watchers[state.worker_id] = watcher
            watcher.start()

    async def run_dns(self, pool: PoolConfig) -> None:
        while True:
            try:
                addresses = await dns.resolve(pool.dns)
            except OSError as exc:
                log.warning("DNS resolution failed", extra={"dns": pool.dns, "error": str(exc)})
            else:
                await self.set_members(pool.name, addresses)
            await asyncio.sleep(self.refresh_s)

    async def set_members(self, pool_name: str, addresses: Sequence[str]) -> None:
        """The pool's members are now `addresses`: new ones are followed, gone ones dropped
        (from the index too)."""
        self._watch(self.router.set_pool_workers(pool_name, addresses))
        for gone in [w for w in self.watchers if w not in
                     {s.worker_id for s in self.router.all_workers()}]:
            await self.watchers.pop(gone).close()

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

    def __init__(self, membership: Membership, timeout_s: float, who: str = "router") -> None:
        self.membership = membership
        self.who = who
        self.deadline = time.monotonic() + timeout_s
        self._ready = False

    def __call__(self) -> bool:
        if not self._ready and (self.membership.is_settled()
                                or time.monotonic() >= self.deadline):
            self._ready = True
            log.info(f"{self.who} ready: its prefix index holds every worker's replayed cache",
                     extra={"indexed_blocks": self.membership.router.index.num_blocks,
                            "workers": len(self.membership.watchers)})
        return self._ready
