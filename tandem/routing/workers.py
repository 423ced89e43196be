"""Workers the router hands out, and the load it counts for them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SlaHints:
    """A request's latency targets (milliseconds) and priority, as the router reads them."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerRef:
    worker_id: str
    address: str
    pool: str


@dataclass(frozen=True, slots=True)
class RouteDecision:
    #: Ordered choices: the first is the pick, the rest are fallbacks.
    decode_workers: tuple[WorkerRef, ...]
    prefill_workers: tuple[WorkerRef, ...] = ()
    encode_workers: tuple[WorkerRef, ...] = ()
    disaggregate: bool = False
    overlap_blocks: int = 0


@dataclass
class InFlight:
    """Requests handed out and not yet completed, per worker.

    Load counts from the moment a worker is handed out (not when it reports it), so a burst of
    requests spreads instead of piling onto the worker that looked idle a moment ago.
    """

    by_request: dict[str, WorkerRef] = field(default_factory=dict)
    by_worker: dict[str, int] = field(default_factory=dict)

    def add(self, request_id: str, worker: WorkerRef) -> None:
        if request_id in self.by_request:
            self.remove(request_id)
        self.by_request[request_id] = worker
        self.by_worker[worker.worker_id] = self.by_worker.get(worker.worker_id, 0) + 1

    def remove(self, request_id: str) -> bool:
        worker = self.by_request.pop(request_id, None)
        if worker is None:
            return False
        self.by_worker[worker.worker_id] -= 1
        return True

    def count(self, worker_id: str) -> int:
        return self.by_worker.get(worker_id, 0)
