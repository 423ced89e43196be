"""A worker's Prometheus metrics. Most are read at scrape time (nothing on the request path):
from the engine's stats, running/waiting requests, KV blocks, prefix-cache hit rate, leases,
transfers, encoded images; from what the worker served (tandem.runtime.served), prefills by
outcome and the KV they leased. KV read latencies and lease hold times are observed as each
read or lease ends."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.engines.types import EngineStats, TransferRecord
from tandem.runtime import build_info
from tandem.runtime.served import ServedStats

#: (name, help, EngineStats field) of the gauges.
_GAUGES = (
    ("tandem_worker_requests_running", "Requests in the running batch", "num_running"),
    ("tandem_worker_requests_waiting", "Requests waiting for admission or for their KV",
     "num_waiting"),
    ("tandem_worker_kv_blocks_used", "KV blocks held", "kv_blocks_used"),
    ("tandem_worker_kv_blocks_total", "KV blocks in the pool", "kv_blocks_total"),
    ("tandem_worker_prefix_cache_hit_rate", "Share of prompt tokens served from the cache",
     "prefix_cache_hit_rate"),
    ("tandem_kv_leases", "Prefill leases held for decode workers", "kv_leases"),
    ("tandem_kv_loading_requests", "Requests whose KV is being read", "num_loading"),
    ("tandem_encode_cache_images", "Images in the encoder cache", "encode_cache_size"),
    ("tandem_worker_kv_host_blocks_used", "KV blocks held in the host tier",
     "kv_host_blocks_used"),
    ("tandem_worker_kv_host_blocks_total", "KV blocks the host tier can hold",
     "kv_host_blocks_total"),
    ("tandem_worker_kv_host_hit_rate", "Share of prompt tokens served from the host KV tier",
     "kv_host_hit_rate"),
    ("tandem_worker_kv_transfer_buffer_blocks_used", "KV blocks held in the transfer buffer "
     "(leases on a prefill worker, reads in flight on a decode worker)",
     "kv_transfer_buffer_blocks_used"),
    ("tandem_worker_kv_transfer_buffer_blocks_total", "KV blocks the transfer buffer holds",
     "kv_transfer_buffer_blocks_total"),
)
#: (name without _total, help, EngineStats field) of the counters.
_COUNTERS = (
    ("tandem_kv_transfer_bytes", "Bytes of KV read from prefill workers", "kv_bytes_received"),
    ("tandem_kv_transfers", "KV reads that completed", "kv_transfers_ok"),
    ("tandem_kv_transfer_failures", "KV reads that failed or found their lease expired",
     "kv_transfers_failed"),
    ("tandem_kv_lease_expiries", "Prefill leases that ran out before release",
     "kv_lease_expiries"),
    ("tandem_kv_reads_buffered", "KV reads through the transfer buffer (one descriptor)",
     "kv_reads_buffered"),
    ("tandem_kv_reads_by_region", "KV reads one descriptor per block, layer and K|V (the "
     "prompt did not fit a transfer buffer: slower, and posted on the worker's loop)",
     "kv_reads_by_region"),
    ("tandem_encode_images", "Images the encoder ran on", "num_encoded_images"),
    ("tandem_encode_cache_hits", "Images answered from the encoder cache (by content hash)",
     "encode_cache_hits"),
    ("tandem_kv_offload_blocks", "KV blocks copied from the device pool to the host tier",
     "kv_offload_blocks"),
    ("tandem_kv_offload_bytes", "Bytes of KV copied from the device pool to the host tier",
     "kv_offload_bytes"),
    ("tandem_kv_offload_seconds", "Time spent copying KV to the host tier (divide by "
     "_offload_blocks for the latency per block)", "kv_offload_seconds"),
    ("tandem_kv_onboard_blocks", "KV blocks copied back from the host tier for prefix hits",
     "kv_onboard_blocks"),
    ("tandem_kv_onboard_bytes", "Bytes of KV copied back from the host tier",
     "kv_onboard_bytes"),
    ("tandem_kv_onboard_seconds", "Time spent copying KV back from the host tier",
     "kv_onboard_seconds"),
    ("tandem_spec_verify_passes", "Speculative decoding: verify passes of one request with "
     "proposals (mean accepted length: 1 + _accepted_tokens / _verify_passes)",
     "spec_verify_passes"),
    ("tandem_spec_proposed_tokens", "Speculative decoding: tokens proposed", "spec_proposed_tokens"),
    ("tandem_spec_accepted_tokens", "Speculative decoding: proposed tokens the target accepted "
     "(acceptance rate: / _proposed_tokens)", "spec_accepted_tokens"),
)
#: (name without _total, help, ServedStats field) of the counters of what the worker served.
_SERVED_COUNTERS = (
    ("tandem_worker_kv_bytes_leased", "Prefill side: bytes of KV the handed-out KV handles made "
     "readable (decode workers read them with one-sided NIXL READs this worker does not see: "
     "what it offered, not what was read)", "kv_bytes_leased"),
    ("tandem_worker_kv_blocks_leased", "Prefill side: KV blocks the handed-out KV handles made "
     "readable", "kv_blocks_leased"),
    ("tandem_worker_kv_leases_released", "Prefill side: leases freed by a Release call (expired "
     "ones: tandem_kv_lease_expiries_total)", "kv_leases_released"),
)
#: outcome label -> ServedStats field of tandem_worker_prefills_total.
_PREFILL_OUTCOMES = (("leased", "prefills_leased"), ("finished", "prefills_finished"),
                     ("failed", "prefills_failed"))
#: KV reads: sub-millisecond (shared memory, NVLink) to tens of seconds (long prompts over TCP).
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                     5, 10, 30, 60)
#: Lease holds: a read's time plus the Release call, up to the lease's length (30 s default).
_HOLD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                 120, 300)


class EngineCollector(Collector):
    def __init__(self, worker_id: str, stats: Callable[[], EngineStats]) -> None:
        self.worker_id = worker_id
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.stats()
        for name, help_text, field in _GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=["worker"])
            gauge.add_metric([self.worker_id], getattr(stats, field))
            yield gauge
        for name, help_text, field in _COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["worker"])
            counter.add_metric([self.worker_id], getattr(stats, field))
            yield counter
        by_position = CounterMetricFamily(
            "tandem_spec_accepted_by_position", "Speculative decoding: verify passes whose "
            "proposal at this position (1: the first) was accepted (acceptance per position: / "
            "tandem_spec_verify_passes_total)", labels=["worker", "position"])
        for i, count in enumerate(stats.spec_accepted_by_position):
            by_position.add_metric([self.worker_id, str(i + 1)], count)
        yield by_position


class ServedCollector(Collector):
    def __init__(self, worker_id: str, served: Callable[[], ServedStats]) -> None:
        self.worker_id = worker_id
        self.served = served

    def collect(self) -> Iterator[CounterMetricFamily]:
        served = self.served()
        prefills = CounterMetricFamily(
            "tandem_worker_prefills", "Prefill calls by outcome: leased (a KV handle handed "
            "out), finished (on the first token: no handle), failed (refused, cancelled or "
            "failed)", labels=["worker", "outcome"])
        for outcome, field in _PREFILL_OUTCOMES:
            prefills.add_metric([self.worker_id, outcome], getattr(served, field))
        yield prefills
        for name, help_text, field in _SERVED_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["worker"])
            counter.add_metric([self.worker_id], getattr(served, field))
            yield counter


class WorkerMetrics:
    """The registry a worker's --metrics-port serves. `served` is read from the scrape's thread
    (ServedTally.snapshot may be)."""

    def __init__(self, worker_id: str, stats: Callable[[], EngineStats], stage: str,
                 served: Callable[[], ServedStats] = ServedStats) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(worker_id, stats))
        self.registry.register(ServedCollector(worker_id, served))
        hold_seconds = Histogram(
            "tandem_worker_kv_lease_hold_seconds", "Prefill side: time from a KV handle handed "
            "out to its lease's end: a Release call (ended=released; the decode worker calls it "
            "once its read is over: this worker's view of the transfer's time, since the "
            "one-sided NIXL READ itself is invisible here) or expiry (ended=expired: the "
            "lease's length)", ("worker", "ended"), buckets=_HOLD_BUCKETS,
            registry=self.registry)
        self._hold_seconds = {ended: hold_seconds.labels(worker_id, ended)
                              for ended in ("released", "expired")}
        self._transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds", "Time to read a request's KV from a prefill worker "
            "(completed reads)", ("worker",), buckets=_TRANSFER_BUCKETS,
            registry=self.registry).labels(worker_id)
        build_info.register(self.registry, stage)

    def observe_transfer(self, record: TransferRecord) -> None:
        if record.error is None:
            self._transfer_seconds.observe(record.duration_s)

    def observe_hold(self, ended: str, seconds: float) -> None:
        """A lease ended (ServedTally.on_hold_end)."""
        self._hold_seconds[ended].observe(seconds)
