"""Which workers a shrinking pool loses first: those whose cached prefixes cost least to lose.

Read from the router's page (tandem.routing.metrics), whose per-worker samples carry the pool:
a worker's cost is the KV blocks the router's prefix index holds for it (prefixes that requests
routed by prefix would have to recompute elsewhere), then the requests the router counts on it
(work that must finish or migrate before it can go). Cheapest first; ties by worker id, so that
two planners (a restarted one) choose alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.planner.exposition import Scrape

INDEXED_BLOCKS = "tandem_router_indexed_blocks"
ACTIVE_REQUESTS = "tandem_router_worker_active_requests"


@dataclass(frozen=True, order=True)
class RemovalCost:
    indexed_blocks: float
    active_requests: float


def pool_workers(scrape: Scrape) -> dict[str, dict[str, RemovalCost]]:
    """Each pool's workers as the router lists them, with what each would cost to remove; with
    several router pages, the highest figures any of them gives."""
    blocks: dict[tuple[str, str], float] = {}
    active: dict[tuple[str, str], float] = {}
    for name, into in ((INDEXED_BLOCKS, blocks), (ACTIVE_REQUESTS, active)):
        for (_, labels), value in scrape.gauges(name).items():
            have = dict(labels)
            if "pool" in have and "worker" in have:
                key = (have["pool"], have["worker"])
                into[key] = max(into.get(key, 0.0), value)
    out: dict[str, dict[str, RemovalCost]] = {}
    for pool, worker in sorted(blocks.keys() | active.keys()):
        out.setdefault(pool, {})[worker] = RemovalCost(blocks.get((pool, worker), 0.0),
                                                        active.get((pool, worker), 0.0))
    return out


def removal_order(workers: dict[str, RemovalCost]) -> list[str]:
    """The workers in the order to remove them (module docstring), cheapest first. All of
    them, not just as many as must go: the router still lists a worker that is draining, which
    the connector skips, taking the next."""
    return [worker for worker, _ in sorted(workers.items(), key=lambda item: (item[1], item[0]))]
