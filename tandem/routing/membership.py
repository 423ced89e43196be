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
        added = self.router.set_pool_workers(pool_name, addresses)
        self._watch(added)
        current = {s.worker_id for s in self.router.all_workers()}
        # Taken out before the first await: another update running meanwhile (the other pool's,
        # or a second reload) finds them gone already rather than closing them twice.
        gone = [self.watchers.pop(w) for w in list(self.watchers) if w not in current]
        for watcher in gone:
            await watcher.close()
        if added or gone:
            self.on_change()  # the pools' candidate counts changed with their members

    async def take_static_members(self, pools: Sequence[PoolConfig]) -> None:
        """The static pools' members as a re-read config lists them (`tandem up` rewrites its
        router's config and signals it when a planner adds or removes workers): each pool the
        router has and that lists workers rather than a DNS name gets exactly those. Anything
        else a config may change (pools, kinds, policies) needs a restart, and is logged."""
        have = {p.name: p.config for p in self.router.pools}
        for pool in pools:
            config = have.get(pool.name)
            if config is None or pool.dns or config.dns or (pool.kind, pool.policy) != (
                    config.kind, config.policy):
                log.warning("config change ignored: only the workers of a static pool change "
                            "without a restart", extra={"pool": pool.name})
                continue
            if set(pool.workers) != set(self.router.pool_members(pool.name)):
                log.info("pool members changed", extra={
                    "pool": pool.name, "workers": list(pool.workers)})
                await self.set_members(pool.name, pool.workers)

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
