"""Routing without a router: what a frontend decides alone while no router replica answers.

The frontend keeps the last worker list a router gave it (Router.ListWorkers: pools, candidacy,
load) and, when every replica is down or restarting, routes on that with a `Router` of its own:
the same pool order, disaggregation and fallback lists as the router's, load counted from its
own hand-outs on top of the last reported load. It has no prefix index (the KV event streams go
to the routers), so the kv policy becomes least_loaded, which needs nothing but those counts; a
Dynamo SLA grid lives in the router's config, so the first serving pool is the pick and the
others its retry order. A worker that died since the list was taken is found by the request
that tries it (the pipeline excludes it and asks again).
"""
from __future__ import annotations

from collections.abc import Sequence

from tandem.errors import Unavailable
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.snapshot import PoolSnapshot
from tandem.routing.workers import Health, RouteDecision

#: The kv policy needs the routers' prefix index; without it the frontend spreads by load.
_POLICY_WITHOUT_INDEX = {"kv": "least_loaded"}


class FallbackRouter:
    """A frontend's own router over the last known worker list."""

    def __init__(self, block_size: int, typical_osl: int = 1024) -> None:
        self.block_size = block_size
        self.typical_osl = typical_osl
        self._router: Router | None = None
        self._pools: list[PoolSnapshot] | None = None
        #: When the list was taken (time.monotonic()); None before the first.
        self.updated_at: float | None = None

    @property
    def num_workers(self) -> int:
        """Workers in the last list (candidates or not)."""
        return len(self._router.all_workers()) if self._router is not None else 0

    def update(self, pools: Sequence[PoolSnapshot], now: float) -> None:
        """Takes a router's fresh list (while routers answer: nothing is routed here then, so
        the counts start again from what the router counted)."""
        configs = [p.as_config(_POLICY_WITHOUT_INDEX.get(p.policy)) for p in pools]
        router = Router(configs, None, self.block_size, self.typical_osl)
        for pool, snapshot in zip(router.pools, pools, strict=True):
            for seen in snapshot.workers:
                state = pool.workers[seen.address]
                state.health = Health.SERVING if seen.candidate else seen.health
                state.events_connected = seen.events_connected
                state.healthy = seen.candidate
                state.report(seen.active_prefill_blocks, seen.active_decode_blocks,
                             seen.active_requests)
        self._router, self._pools, self.updated_at = router, list(pools), now

    def pools(self) -> list[PoolSnapshot] | None:
        """The last list as it was taken; None before the first."""
        return self._pools

    def route(self, info: RouteRequestInfo) -> RouteDecision:
        """As Router.route, on the last list.

        Raises:
            Unavailable: no list yet, or no candidate in it for this request.
        """
        if self._router is None:
            raise Unavailable("no router answers and none has listed the workers yet")
        return self._router.route(info)

    def complete(self, request_id: str) -> None:
        if self._router is not None:
            self._router.complete(request_id)
