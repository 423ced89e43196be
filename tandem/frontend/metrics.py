"""Frontend Prometheus metrics (names follow Dynamo's frontend metrics, tandem_ prefix).
Buckets span LLM latencies: milliseconds for ITL, up to minutes for whole requests."""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.engines.types import Usage

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300)
#: Per-hop latency of a streamed token: 25 us to 1 s.
_HOP_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 750e-6, 0.001, 0.0015, 0.002, 0.003,
                0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
#: The `status` of a request whose client went away before the answer was complete (nginx's
#: "client closed request").
CLIENT_CLOSED = "499"


class FrontendMetrics:
    """The frontend's metrics, labelled with one served model; `for_model` gives another
    model's view of the same collectors (one registry, one /metrics page)."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ("model",)
        self.requests = Counter("tandem_frontend_requests", "Requests by endpoint and status "
                                "(the HTTP status; 499: the client left)",
                                ("model", "endpoint", "status"), registry=r)
        self.in_flight = Gauge("tandem_frontend_inflight_requests", "Requests being served",
                               labels, registry=r)
        self.queued = Gauge("tandem_frontend_queued_requests", "Requests not yet answered with "
                            "a first token (tokenizing, routing, prefilling)", labels, registry=r)
        self.arrivals = Counter("tandem_frontend_arrivals", "Generations handed to routing, "
                                "counted as they arrive (one per choice); the planner's request "
                                "rate", labels, registry=r)
        self.arrival_prompt_tokens = Counter(
            "tandem_frontend_arrival_prompt_tokens", "Prompt tokens of the generations counted "
            "in tandem_frontend_arrivals, as they arrive", labels, registry=r)
        self.queued_prompt_tokens = Gauge(
            "tandem_frontend_queued_prompt_tokens", "Prompt tokens of the generations not yet "
            "prefilled (routing, waiting for a worker, prefilling): no first token made",
            labels, registry=r)
        self.queued_generations = Gauge(
            "tandem_frontend_queued_generations", "The generations counted in "
            "tandem_frontend_queued_prompt_tokens", labels, registry=r)
        self.prefill_gate_waiting = Gauge(
            "tandem_frontend_prefill_gate_waiting", "Prompts waiting in the frontend for a "
            "prefill worker with room (--prefill-queue-tokens)", labels, registry=r)
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
        self.output_tokens_total = Counter("tandem_frontend_output_tokens", "Generated tokens, "
                                           "counted as they stream", labels, registry=r)
        self.cached_tokens = Counter("tandem_frontend_cached_tokens", "Prompt tokens served "
                                     "from the prefix cache", labels, registry=r)
        self.disconnects = Counter("tandem_frontend_client_disconnects",
                                   "Clients that went away mid-request", labels, registry=r)
        self.migrations = Counter("tandem_frontend_migrations", "Requests moved to another "
                                  "decode worker after their stream broke midway", labels,
                                  registry=r)
        self.refusals = Counter("tandem_frontend_worker_refusals", "Requests a decode worker "
                                "refused before it streamed (unavailable, overloaded): the "
                                "router was asked again without it", labels, registry=r)
        self.token_hops = Histogram(
            "tandem_frontend_token_hop_seconds", "Latency of a streamed token by hop: "
            "engine_to_send (engine step -> decode worker sends the batch), send_to_receive "
            "(-> this frontend reads it), receive_to_sse (-> its SSE event written to the "
            "client); one sample per batch read (Decode.Session only)", [*labels, "hop"],
            buckets=_HOP_BUCKETS, registry=r)
        self.router_fallback = Gauge(
            "tandem_frontend_router_fallback", "1 while none of the model's router replicas "
            "answers and this frontend routes alone on the last worker list (kv-aware routing "
            "off), else 0", labels, registry=r)
        self.fallback_routes = Counter(
            "tandem_frontend_fallback_routes", "Requests this frontend routed alone because no "
            "router replica answered", labels, registry=r)
        self.local_routes = Counter(
            "tandem_frontend_local_routes", "Requests this frontend's local router routed (no "
            "Route call to a router replica)", labels, registry=r)
        self.local_candidates = Gauge(
            "tandem_frontend_local_candidates", "Workers this frontend's local router routes "
            "to (health SERVING, event stream up), by pool kind, as of its last look at the "
            "router's worker list (every few seconds)", [*labels, "kind"], registry=r)
        self._bind(model)

    def _bind(self, model: str) -> None:
        self.model = model
        self._hops = {hop: self.token_hops.labels(model, hop)
                      for hop in ("engine_to_send", "send_to_receive", "receive_to_sse")}
        self._ttft = self.ttft.labels(model)
        self._itl = self.itl.labels(model)
        self._streamed = self.output_tokens_total.labels(model)
        # Exported at 0 from the start (a labelled metric shows only the children it has).
        self.router_fallback.labels(model)
        self.fallback_routes.labels(model)
        self.refusals.labels(model)
        self.migrations.labels(model)
        self._local_routes = self.local_routes.labels(model)
        self._arrivals = self.arrivals.labels(model)
        self._arrival_tokens = self.arrival_prompt_tokens.labels(model)
        self._queued_tokens = self.queued_prompt_tokens.labels(model)
        self._queued_generations = self.queued_generations.labels(model)
        self._prefill_gate_waiting = self.prefill_gate_waiting.labels(model)

    def for_model(self, model: str) -> FrontendMetrics:
        """These metrics (same collectors and registry) labelled with `model`."""
        other = copy.copy(self)
        other._bind(model)
        return other

    def set_router_fallback(self, active: bool) -> None:
        self.router_fallback.labels(self.model).set(int(active))

    def count_fallback_route(self) -> None:
        self.fallback_routes.labels(self.model).inc()

    def count_local_route(self) -> None:
        self._local_routes.inc()

    def set_local_candidates(self, counts: dict[str, int]) -> None:
        for kind, count in counts.items():
            self.local_candidates.labels(self.model, kind).set(count)

    @contextlib.contextmanager
    def waiting_for_prefill_room(self) -> Iterator[None]:
        """Counts a prompt in tandem_frontend_prefill_gate_waiting while it is inside."""
        self._prefill_gate_waiting.inc()
        try:
            yield
        finally:
            self._prefill_gate_waiting.dec()

    def arrive(self, prompt_tokens: int) -> QueuedPrompt:
        """Counts one generation as it arrives; it and its prompt wait (queued_generations,
        queued_prompt_tokens) until the returned handle's `answered`."""
        self._arrivals.inc()
        self._arrival_tokens.inc(prompt_tokens)
        return QueuedPrompt(self._queued_generations, self._queued_tokens, prompt_tokens)

    def observe_chunk(self, ttft_s: float | None, gap_s: float, num_tokens: int) -> None:
        self._streamed.inc(num_tokens)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        elif num_tokens:
            self._itl.observe(gap_s / num_tokens)

    def observe_batch_hops(self, produced_ns: int, sent_ns: int, received_ns: int) -> None:
        """The first two hops of a batch read from a decode worker (worker's clock, then ours)."""
        self._hops["engine_to_send"].observe(max(sent_ns - produced_ns, 0) / 1e9)
        self._hops["send_to_receive"].observe(max(received_ns - sent_ns, 0) / 1e9)

    def observe_sse_hop(self, received_ns: int) -> None:
        """The last hop: from reading a chunk to having written its SSE event."""
        self._hops["receive_to_sse"].observe(max(time.time_ns() - received_ns, 0) / 1e9)

    def track(self, endpoint: str) -> RequestTracker:
        """Starts accounting for one request that just arrived."""
        return RequestTracker(self, endpoint)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class QueuedPrompt:
    """One generation, and its prompt tokens, in the queued gauges; taken out once (`answered`:
    its first token made, or its end without one)."""

    def __init__(self, generations: Gauge, tokens: Gauge, num_tokens: int) -> None:
        self._generations, self._tokens, self._num_tokens = generations, tokens, num_tokens
        self._waiting = True
        generations.inc()
        tokens.inc(num_tokens)

    def answered(self) -> None:
        if self._waiting:
            self._waiting = False
            self._generations.dec()
            self._tokens.dec(self._num_tokens)


class RequestTracker:
    """One request's share of the metrics: in flight (and queued until its first token) from
    arrival to `finish`, which counts it by status and observes its duration and tokens."""

    def __init__(self, metrics: FrontendMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.started = time.perf_counter()
        self._is_queued = True
        self._is_done = False
        metrics.in_flight.labels(metrics.model).inc()
        metrics.queued.labels(metrics.model).inc()

    def relabel(self, metrics: FrontendMetrics) -> None:
        """Counts the request under `metrics`' model from now on (an API that learns the
        model from the body starts tracking before it has read it)."""
        if metrics.model == self.metrics.model or self._is_done:
            return
        for gauge, counted in ((self.metrics.in_flight, True), (self.metrics.queued,
                                                                 self._is_queued)):
            if counted:
                gauge.labels(self.metrics.model).dec()
                gauge.labels(metrics.model).inc()
        self.metrics = metrics

    def first_token(self) -> None:
        """The answer started: the request leaves the queue."""
        if self._is_queued:
            self._is_queued = False
            self.metrics.queued.labels(self.metrics.model).dec()

    def finish(self, status: str, usage: Usage | None = None) -> None:
        """Counts the request once, whatever the path that ended it."""
        if self._is_done:
            return
        self._is_done = True
        self.first_token()
        m, model = self.metrics, self.metrics.model
        m.in_flight.labels(model).dec()
        m.duration.labels(model).observe(time.perf_counter() - self.started)
        m.requests.labels(model, self.endpoint, status).inc()
        if status == CLIENT_CLOSED:
            m.disconnects.labels(model).inc()
        if usage is not None:
            m.input_tokens.labels(model).observe(usage.prompt_tokens)
            m.output_tokens.labels(model).observe(usage.completion_tokens)
            m.cached_tokens.labels(model).inc(usage.cached_tokens)
