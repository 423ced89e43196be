"""Router Prometheus metrics: decisions per pool and worker, prefix overlap, decision latency,
worker candidacy."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.routing.workers import RouteDecision

#: worker id -> (its pool, blocks the index holds for it, requests the router counts on it).
IndexCounts = dict[str, tuple[str, int, int]]


class IndexCollector(Collector):
    """Blocks the router's prefix index holds per worker, computed at scrape time. Each sample
    names the worker's pool too: a planner reads from this page which workers each pool has
    now and what each would cost to remove (tandem.planner.removal)."""

    def __init__(self, counts: Callable[[], IndexCounts]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["pool", "worker"]
        blocks = GaugeMetricFamily("tandem_router_indexed_blocks",
                                   "KV blocks the router knows a worker holds", labels=labels)
        load = GaugeMetricFamily("tandem_router_worker_active_requests",
                                 "Requests the router counts on a worker (reported + handed out)",
                                 labels=labels)
        for worker, (pool, num_blocks, num_requests) in sorted(self.counts().items()):
            blocks.add_metric([pool, worker], num_blocks)
            load.add_metric([pool, worker], num_requests)
        yield blocks
        yield load

_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
_BLOCK_BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("tandem_router_decisions", "Workers handed out, by pool and "
                                 "worker (a disaggregated request counts in both its pools)",
                                 ("pool", "worker"), registry=r)
        self.overlap_blocks = Histogram("tandem_router_overlap_blocks",
                                        "Prompt blocks already cached on the chosen worker",
                                        ("pool",), buckets=_BLOCK_BUCKETS, registry=r)
        self.latency = Histogram("tandem_router_decision_seconds", "Time to route a request",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.unroutable = Counter("tandem_router_unavailable",
                                  "Requests no healthy worker could take", registry=r)
        self.healthy_workers = Gauge("tandem_router_healthy_workers",
                                     "Workers in the candidate set", ("pool",), registry=r)

    def watch_index(self, counts: Callable[[], IndexCounts]) -> None:
        self.registry.register(IndexCollector(counts))

    def observe(self, decision: RouteDecision, seconds: float) -> None:
        """Counts the decode pick and, when disaggregated, the prefill pick (in its pool). The
        overlap is that of the worker that computes the prompt: the prefill pick, if any."""
        pick = decision.pick
        self.decisions.labels(pick.pool, pick.worker_id).inc()
        if decision.disaggregate:
            pick = decision.prefill_workers[0]
            self.decisions.labels(pick.pool, pick.worker_id).inc()
        self.overlap_blocks.labels(pick.pool).observe(decision.overlap_blocks)
        self.latency.observe(seconds)
