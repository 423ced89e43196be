"""A frontend's own router: the router service's decision, made in the frontend's process.

Every request used to pay a Route round trip to a router process (about 1 ms of CPU on each
side, and a hop before the first token). The router service stays the one source of truth for
what is configured: the pools, their members and policies and the SLA grid reach the frontend in
its ListWorkers answer (pools plus RoutingSettings), taken every few seconds. What a
decision needs live (each worker's health, its load reports and the prefixes it caches) the
local router takes from the workers themselves, over the same streams the router service follows
(tandem.routing.membership: one WorkerWatcher per worker). So it decides as a router replica
does: same pools, policies and grid, prefix index from the same events, load from the workers'
reports plus its own hand-outs. It keeps deciding, prefix-aware, while every router replica is
down; the router service then only misses this frontend's hand-outs, which the workers' load
reports carry to it anyway.

It decides only once ready, as a (re)started router does: every worker's event stream has
replayed its cache into the index (or `sync_timeout_s` passed).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

from tandem.errors import Unavailable
from tandem.routing.grid_config import load_grid_config
from tandem.routing.membership import Membership, Readiness
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.snapshot import PoolSnapshot, RoutingSettings
from tandem.routing.workers import RouteDecision
from tandem.runtime.tasks import spawn
from tandem.runtime.tls import TlsConfig

log = logging.getLogger(__name__)


def _layout(pools: Sequence[PoolSnapshot], settings: RoutingSettings) -> tuple[object, ...]:
    """What a change of forces a new router: everything listed but the members."""
    return (settings, tuple((p.name, p.kind, p.policy, p.prefill_load_scale, p.temperature,
                             p.host_hit_cost) for p in pools))


class LocalRouter:
    """The router of one model's pools inside a frontend process (module docstring)."""

    def __init__(self, tls: TlsConfig | None = None, sync_timeout_s: float = 10.0) -> None:
        self.tls = tls
        self.sync_timeout_s = sync_timeout_s
        self._router: Router | None = None
        self._membership: Membership | None = None
        self._ready: Readiness | None = None
        self._layout: tuple[object, ...] | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def is_ready(self) -> bool:
        """Whether it may decide: a list was taken and the index rebuilt (module docstring)."""
        return self._ready is not None and self._ready()

    def update(self, pools: Sequence[PoolSnapshot], settings: RoutingSettings) -> None:
        """Takes the router service's list: the first builds the router and follows every
        worker; later ones add and drop members; a changed layout (pools, policies, grid,
        block size) builds it again. Call on the event loop."""
        layout = _layout(pools, settings)
        if layout != self._layout:
            self._rebuild(pools, settings, layout)
            return
        assert self._membership is not None
        for pool in pools:
            addresses = [w.address for w in pool.workers]
            if set(addresses) != set(self._membership.router.pool_members(pool.name)):
                spawn(self._membership.set_members(pool.name, addresses), self._background)

    def _rebuild(self, pools: Sequence[PoolSnapshot], settings: RoutingSettings,
                 layout: tuple[object, ...]) -> None:
        grid = (load_grid_config(json.loads(settings.grid_config_json))
                if settings.grid_config_json else None)
        router = Router([p.as_config() for p in pools], grid, settings.block_size,
                        settings.typical_osl)
        if self._membership is not None:
            spawn(self._membership.close(), self._background)
            log.info("the router's pools changed: the frontend's local router starts over",
                     extra={"pools": [p.name for p in pools]})
        # Only kv pools' workers send this process their KV events: it keeps no index for
        # status, as the router service does.
        self._membership = Membership(router, refresh_s=0.0, on_change=lambda: None,
                                      tls=self.tls, index_all=False)
        self._membership.start(())
        self._ready = Readiness(self._membership, self.sync_timeout_s, "the frontend's local router")
        self._router, self._layout = router, layout

    def candidate_counts(self) -> dict[str, int]:
        """Workers this process would route to now (health SERVING, event stream up), by pool
        kind; empty before the first list."""
        counts: dict[str, int] = {}
        for pool in self._router.pools if self._router is not None else ():
            healthy = sum(w.healthy for w in list(pool.workers.values()))
            counts[pool.config.kind] = counts.get(pool.config.kind, 0) + healthy
        return counts

    def route(self, info: RouteRequestInfo) -> RouteDecision:
        """As the router service's Route (call only when `is_ready`).

        Raises:
            Unavailable: no candidate for this request as this process sees the workers.
        """
        if self._router is None:
            raise Unavailable("the local router has no worker list yet")
        return self._router.route(info)

    def complete(self, request_id: str) -> None:
        if self._router is not None:
            self._router.complete(request_id)

    async def close(self) -> None:
        if self._membership is not None:
            await self._membership.close()
        await asyncio.gather(*self._background, return_exceptions=True)
