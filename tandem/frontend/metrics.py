"""Frontend Prometheus metrics (names follow Dynamo's frontend metrics, tandem_ prefix).
Buckets span LLM latencies: milliseconds for ITL, up to minutes for whole requests."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class FrontendMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ("model",)
        self.requests = Counter("tandem_frontend_requests", "Requests by endpoint and status",
                                ("model", "endpoint", "status"), registry=r)
        self.in_flight = Gauge("tandem_frontend_inflight_requests", "Requests being served",
                               labels, registry=r)
        self.ttft = Histogram("tandem_frontend_time_to_first_token_seconds", "TTFT", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_frontend_inter_token_latency_seconds",
                             "Time between streamed chunks divided by their tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("tandem_frontend_request_duration_seconds", "Request duration",
                                  labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.input_tokens = Histogram("tandem_frontend_input_sequence_tokens", "Prompt tokens",
                                      labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("tandem_frontend_output_sequence_tokens",
                                       "Generated tokens", labels, buckets=_TOKEN_BUCKETS,
                                       registry=r)
        self.cached_tokens = Counter("tandem_frontend_cached_tokens", "Prompt tokens served "
                                     "from the prefix cache", labels, registry=r)
        self.disconnects = Counter("tandem_frontend_client_disconnects",
                                   "Clients that went away mid-request", labels, registry=r)
        self._ttft = self.ttft.labels(model)
        self._itl = self.itl.labels(model)
        self.model = model

    def observe_chunk(self, ttft_s: float | None, gap_s: float, num_tokens: int) -> None:
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        elif num_tokens:
            self._itl.observe(gap_s / num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
