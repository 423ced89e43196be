"""What the planner observes each interval, read from the metrics Tandem's services export.

Why Prometheus pages and not the router's event stream: the load the planner sizes for (request
rate, prompt and output lengths, TTFT and ITL as clients see them) is measured only at the
frontend, which has no stream; the workers' and router's pages add each worker's running and
waiting requests and KV usage, and the router's healthy workers per pool. Reading the same pages
Prometheus scrapes keeps one source of truth, lets a restarted planner resume from counters
(which outlive it), and needs nothing new in the services.

The metrics used, by the names the services export them under:

- frontend (tandem.frontend.metrics), label ``model``:
  ``tandem_frontend_time_to_first_token_seconds`` (histogram; its count is the requests that
  started streaming: the arrival rate, a TTFT later), ``..._inter_token_latency_seconds``
  (histogram, one observation per streamed chunk), ``..._input_sequence_tokens`` and
  ``..._output_sequence_tokens`` (histograms, one observation per finished request),
  ``tandem_frontend_requests_total`` (finished requests), ``tandem_frontend_inflight_requests``,
  ``tandem_frontend_arrivals_total`` and ``..._arrival_prompt_tokens_total`` (generations and
  their prompt tokens as they arrive: the rate and ISL the pools are sized for, known before
  any of them is answered; a frontend without them, an older one, is read by its first
  tokens and finished requests instead, as is every frontend while one does not count them),
  ``tandem_frontend_queued_requests`` (requests not yet answered with a first token),
  ``..._queued_generations`` and ``..._queued_prompt_tokens`` (generations, and their prompt
  tokens, not yet prefilled);
- workers (tandem.runtime.worker_metrics), label ``worker``:
  ``tandem_worker_requests_running``, ``..._requests_waiting``, ``..._kv_blocks_used``,
  ``..._kv_blocks_total``;
- router (tandem.routing.metrics), label ``pool``: ``tandem_router_healthy_workers``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tandem.planner.exposition import Scrape, counter_increase, histogram_increase

TTFT = "tandem_frontend_time_to_first_token_seconds"
ITL = "tandem_frontend_inter_token_latency_seconds"
ISL = "tandem_frontend_input_sequence_tokens"
OSL = "tandem_frontend_output_sequence_tokens"
REQUESTS = "tandem_frontend_requests"
INFLIGHT = "tandem_frontend_inflight_requests"
ARRIVALS = "tandem_frontend_arrivals"
ARRIVAL_TOKENS = "tandem_frontend_arrival_prompt_tokens"
QUEUED = "tandem_frontend_queued_requests"
QUEUED_TOKENS = "tandem_frontend_queued_prompt_tokens"
QUEUED_GENERATIONS = "tandem_frontend_queued_generations"
RUNNING = "tandem_worker_requests_running"
WAITING = "tandem_worker_requests_waiting"
KV_USED = "tandem_worker_kv_blocks_used"
KV_TOTAL = "tandem_worker_kv_blocks_total"
HEALTHY = "tandem_router_healthy_workers"


@dataclass(frozen=True)
class FrontendInterval:
    """The traffic the frontends saw between two scrape rounds. A figure that needs requests
    the interval did not have (a mean, a quantile) is None."""

    duration_s: float
    #: Requests that got their first token, per second.
    request_rate: float
    #: Requests that finished (any status).
    num_finished: float
    #: Mean prompt and output lengths of the requests that finished, tokens.
    mean_isl: float | None
    mean_osl: float | None
    #: TTFT and ITL quantiles (`quantile`, 0.9 by default) and means, ms.
    ttft_ms: float | None
    itl_ms: float | None
    mean_ttft_ms: float | None
    mean_itl_ms: float | None
    #: Requests being served at the later scrape, and at the earlier one.
    num_inflight: float
    num_inflight_before: float = 0.0
    #: Generations that arrived, per second, and their mean prompt length (tokens); None
    #: from a frontend that does not count arrivals, the mean also when none arrived.
    arrival_rate: float | None = None
    mean_arrival_isl: float | None = None
    #: Requests not yet answered with a first token at the later scrape; generations, and
    #: their prompt tokens, not yet prefilled.
    num_queued: float = 0.0
    queued_generations: float = 0.0
    queued_prompt_tokens: float = 0.0

    @property
    def sizing_rate(self) -> float:
        """The request rate the pools are sized for: counted at arrival where the frontends
        count arrivals (a burst queued on a saturated pool reaches few first tokens), else at
        the first token."""
        return self.request_rate if self.arrival_rate is None else self.arrival_rate

    @property
    def sizing_isl(self) -> float | None:
        """The prompt length the pools are sized for: the arriving requests' where known (a
        shift to longer prompts shows at once, not as they finish), else the finished ones'."""
        return self.mean_isl if self.mean_arrival_isl is None else self.mean_arrival_isl

    @property
    def inflight_floor(self) -> float:
        """The requests in flight at the later scrape while the load goes on: some arrived in
        the interval (were answered, with a frontend that does not count arrivals), grew in
        number, or still wait for a first token. 0 once it stopped (the planner's floor on
        decode streams, tandem.planner.demand)."""
        going_on = (self.sizing_rate > 0 or self.num_inflight > self.num_inflight_before
                    or self.num_queued > 0)
        return self.num_inflight if going_on else 0.0


def frontend_interval(before: Scrape, after: Scrape, model: str | None = None,
                      quantile: float = 0.9) -> FrontendInterval:
    """The interval between two scrape rounds of the frontends' pages, for one served `model`
    (None: all). Raises ValueError when `after` is not later than `before`."""
    duration = after.time_s - before.time_s
    if duration <= 0:
        raise ValueError(f"the later scrape must be later (got {duration} s between them)")
    match = None if model is None else {"model": model}
    ttft, itl = (histogram_increase(before, after, n, match) for n in (TTFT, ITL))
    isl, osl = (histogram_increase(before, after, n, match) for n in (ISL, OSL))
    # Arrivals only where every frontend counts them (one that does not, an older one in a
    # rolling upgrade, would have its traffic missed).
    counting = {instance for instance, _ in after.gauges(ARRIVALS + "_total", match)}
    counts_arrivals = bool(counting) and _frontends(after, match) <= counting
    arrived = counter_increase(before, after, ARRIVALS, match)
    arrived_tokens = counter_increase(before, after, ARRIVAL_TOKENS, match)
    queued_generations, queued_tokens = queued_load(after, model)
    return FrontendInterval(
        duration_s=duration,
        request_rate=ttft.count / duration,
        num_finished=counter_increase(before, after, REQUESTS, match),
        mean_isl=isl.mean,
        mean_osl=osl.mean,
        ttft_ms=_ms(ttft.quantile(quantile)),
        itl_ms=_ms(itl.quantile(quantile)),
        mean_ttft_ms=_ms(ttft.mean),
        mean_itl_ms=_ms(itl.mean),
        num_inflight=inflight_requests(after, model),
        num_inflight_before=inflight_requests(before, model),
        arrival_rate=arrived / duration if counts_arrivals else None,
        mean_arrival_isl=arrived_tokens / arrived if counts_arrivals and arrived else None,
        num_queued=_gauge_sum(after, QUEUED, match),
        queued_generations=queued_generations,
        queued_prompt_tokens=queued_tokens)


def inflight_requests(scrape: Scrape, model: str | None = None) -> float:
    """Requests the frontends were serving at the scrape (queued and streaming), for one served
    `model` (None: all)."""
    return _gauge_sum(scrape, INFLIGHT, None if model is None else {"model": model})


def queued_load(scrape: Scrape, model: str | None = None) -> tuple[float, float]:
    """Generations, and their prompt tokens, the frontends had waiting to be prefilled at the
    scrape, for one served `model` (None: all)."""
    match = None if model is None else {"model": model}
    return (_gauge_sum(scrape, QUEUED_GENERATIONS, match),
            _gauge_sum(scrape, QUEUED_TOKENS, match))


def _frontends(scrape: Scrape, match: Mapping[str, str] | None) -> set[str]:
    """The instances with a frontend sample whose labels include `match`."""
    wanted = set((match or {}).items())
    return {instance for instance, name, labels in scrape.samples
            if name.startswith("tandem_frontend_") and wanted <= set(labels)}


def _gauge_sum(scrape: Scrape, name: str, match: Mapping[str, str] | None) -> float:
    return sum(scrape.gauges(name, match).values())


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's gauges at a scrape."""

    worker: str
    num_running: float
    num_waiting: float
    #: KV blocks held / blocks in the pool; None when the worker reports no pool.
    kv_usage: float | None


def worker_loads(scrape: Scrape) -> dict[str, WorkerLoad]:
    """Each worker's load, by the worker id of its ``worker`` label."""
    def by_worker(name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, labels), value in scrape.gauges(name).items():
            if worker := dict(labels).get("worker"):
                out[worker] = value
        return out

    running, waiting = by_worker(RUNNING), by_worker(WAITING)
    used, total = by_worker(KV_USED), by_worker(KV_TOTAL)
    return {w: WorkerLoad(w, running[w], waiting.get(w, 0.0),
                          used.get(w, 0.0) / total[w] if total.get(w) else None)
            for w in sorted(running)}


@dataclass(frozen=True)
class PoolLoad:
    """A pool's workers' load at a scrape, averaged over the workers that reported."""

    pool: str
    num_reporting: int
    mean_running: float
    mean_waiting: float
    mean_kv_usage: float | None


def pool_loads(scrape: Scrape, workers_by_pool: Mapping[str, Iterable[str]]
               ) -> dict[str, PoolLoad]:
    """Each pool's load, from the worker ids the deployment (or the router's worker list) puts
    in it; a worker that did not report is left out of its pool's means."""
    loads = worker_loads(scrape)
    out = {}
    for pool, workers in workers_by_pool.items():
        seen = [loads[w] for w in workers if w in loads]
        n = len(seen)
        kv = [w.kv_usage for w in seen if w.kv_usage is not None]
        out[pool] = PoolLoad(pool, n,
                             sum(w.num_running for w in seen) / n if n else 0.0,
                             sum(w.num_waiting for w in seen) / n if n else 0.0,
                             sum(kv) / len(kv) if kv else None)
    return out


def healthy_workers(scrape: Scrape) -> dict[str, int]:
    """Workers each pool has in its router's candidate set (the deployment's actual size), by
    pool name; with several router replicas, the most any replica counts."""
    out: dict[str, int] = {}
    for (_, labels), value in scrape.gauges(HEALTHY).items():
        if pool := dict(labels).get("pool"):
            out[pool] = max(out.get(pool, 0), int(value))
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
