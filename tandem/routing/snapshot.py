"""What the router knows of its pools and workers at one moment, for operators and launchers
(Router.ListWorkers, `tandem status`, `tandem up`'s readiness)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.routing.config import PoolConfig
from tandem.routing.workers import Health, LoadReport, WorkerState


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    worker_id: str
    address: str
    #: Route may choose it now (health SERVING and event stream connected).
    candidate: bool
    health: Health
    events_connected: bool
    #: Why it is not a candidate, for people; "" when it is one.
    reason: str
    #: Requests routed to it and not completed yet.
    in_flight_requests: int
    #: The load the router routes on: the last report plus what it handed out since.
    active_requests: int
    active_prefill_blocks: int
    active_decode_blocks: int
    #: Blocks the router's prefix index holds for it.
    indexed_blocks: int
    #: Its own last report, and the seconds since that arrived; None before the first.
    last_load: LoadReport | None
    last_load_age_s: float | None

    @classmethod
    def of(cls, worker: WorkerState, in_flight: int, indexed_blocks: int, now: float
           ) -> WorkerSnapshot:
        """`worker` as of `now` (time.monotonic(), the clock of its `last_load_at`)."""
        loaded = worker.last_load is not None
        return cls(worker.worker_id, worker.ref.address, worker.healthy, worker.health,
                   worker.events_connected, worker.candidacy_reason(), in_flight,
                   worker.active_requests, worker.active_prefill_blocks,
                   worker.active_decode_blocks, indexed_blocks, worker.last_load,
                   max(now - worker.last_load_at, 0.0) if loaded else None)


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    name: str
    kind: str
    policy: str
    #: In the router's config order (a DNS pool's: as they appeared).
    workers: tuple[WorkerSnapshot, ...]
    #: The kv policy's weights (PoolConfig's fields of the same names).
    prefill_load_scale: float = PoolConfig.prefill_load_scale
    temperature: float = PoolConfig.temperature
    host_hit_cost: float = PoolConfig.host_hit_cost

    def as_config(self, policy: str | None = None) -> PoolConfig:
        """The pool as a router config lists it, its current members as static workers
        (`policy` in place of its own when given)."""
        return PoolConfig(name=self.name, kind=self.kind,
                          workers=[w.address for w in self.workers],
                          policy=policy or self.policy,
                          prefill_load_scale=self.prefill_load_scale,
                          temperature=self.temperature, host_hit_cost=self.host_hit_cost)


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """How a router decides, beside its pools (RouterConfig's fields of the same names; the
    grid as the JSON text the router read, "" for none)."""

    block_size: int
    typical_osl: int
    grid_config_json: str = ""


def all_candidates(pools: Sequence[PoolSnapshot]) -> bool:
    """Whether every worker of every pool is a candidate (what `tandem up` calls ready). At
    least one worker must exist: a router with no worker yet serves nothing."""
    workers = [w for pool in pools for w in pool.workers]
    return bool(workers) and all(w.candidate for w in workers)


def not_candidates(pools: Sequence[PoolSnapshot]) -> list[tuple[str, WorkerSnapshot]]:
    """(pool name, worker) of every worker that is not a candidate."""
    return [(pool.name, w) for pool in pools for w in pool.workers if not w.candidate]
