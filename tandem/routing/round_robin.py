"""The minimal router: round robin over one pool of decode workers, with in-flight counting."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.errors import InvalidRequest, Unavailable
from tandem.routing.workers import InFlight, RouteDecision, WorkerRef


class RoundRobinRouter:
    """Hands out decode workers in turn; fallbacks follow in the same rotation."""

    def __init__(self, workers: Sequence[WorkerRef]) -> None:
        self.workers = list(workers)
        self.in_flight = InFlight()
        self._next = 0

    def route(self, request_id: str, exclude_ids: Sequence[str] = ()) -> RouteDecision:
        candidates = [w for w in self.workers if w.worker_id not in exclude_ids]
        if not candidates:
            raise Unavailable("no decode worker available"
                              + (f" (excluded: {', '.join(exclude_ids)})" if exclude_ids else ""))
        start = self._next % len(candidates)
        self._next += 1
        ordered = tuple(candidates[start:] + candidates[:start])
        self.in_flight.add(request_id, ordered[0])
        return RouteDecision(decode_workers=ordered)

    def complete(self, request_id: str) -> bool:
        return self.in_flight.remove(request_id)


#: Router policies by name (the grid and KV-aware policies join here).
POLICIES: dict[str, Callable[[Sequence[WorkerRef]], RoundRobinRouter]] = {
    "round_robin": RoundRobinRouter,
}


def create_router(policy: str, workers: Sequence[WorkerRef]) -> RoundRobinRouter:
    """Builds the named policy. Raises InvalidRequest listing the supported names."""
    factory = POLICIES.get(policy)
    if factory is None:
        raise InvalidRequest(f"unknown router policy '{policy}'; supported: "
                             f"{', '.join(sorted(POLICIES))}", param="policy")
    return factory(workers)
