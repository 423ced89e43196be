"""Observations from the exposition text the real metric objects write (the frontend's, the
workers', the router's), against hand-computed rates, means and bucket quantiles."""
from __future__ import annotations

import functools

import pytest
from prometheus_client import generate_latest

from tandem.engines.types import EngineStats, Usage
from tandem.frontend.metrics import FrontendMetrics
from tandem.planner.exposition import (
    HistogramDelta,
    counter_increase,
    histogram_increase,
    parse_scrape,
)
from tandem.planner.observe import (
    frontend_interval,
    healthy_workers,
    pool_loads,
    worker_loads,
)
from tandem.routing.metrics import RouterMetrics
from tandem.runtime.worker_metrics import WorkerMetrics


def _serve(metrics: FrontendMetrics, ttft_s: float, itl_s: list[float], isl: int,
           osl: int) -> None:
    """One streamed request through the frontend's own accounting (the pipeline's share:
    arrival, first token)."""
    tracker = metrics.track("chat_completions")
    metrics.arrive(isl).answered()
    metrics.observe_chunk(ttft_s, 0.0, 1)
    for gap in itl_s:
        metrics.observe_chunk(None, gap, 1)
    tracker.finish("200", Usage(prompt_tokens=isl, completion_tokens=osl))


def _same(stats: EngineStats) -> EngineStats:
    return stats


def _page(metrics: FrontendMetrics) -> str:
    return metrics.render().decode()


def test_an_interval_of_frontend_traffic() -> None:
    metrics = FrontendMetrics("demo")
    for _ in range(20):  # before the interval: must not count
        _serve(metrics, 0.001, [0.001], isl=8000, osl=8000)
    before = parse_scrape({"frontend-0": _page(metrics)}, time_s=100.0)
    # In the interval: 10 requests. TTFTs: 5 x 30 ms (bucket <= 0.05), 3 x 200 ms (<= 0.25),
    # 2 x 3 s (<= 5). ISLs 100 x 5 + 300 x 5, OSLs 10 each.
    for ttft in [0.03] * 5 + [0.2] * 3 + [3.0] * 2:
        _serve(metrics, ttft, [0.02, 0.02, 0.02, 0.3], isl=100 if ttft < 0.1 else 300, osl=10)
    metrics.track("chat_completions")  # one still in flight, no first token yet
    after = parse_scrape({"frontend-0": _page(metrics)}, time_s=120.0)

    seen = frontend_interval(before, after, model="demo")
    assert seen.duration_s == 20.0
    assert seen.request_rate == pytest.approx(10 / 20)
    assert seen.num_finished == 10
    assert seen.mean_isl == pytest.approx(200) and seen.mean_osl == pytest.approx(10)
    # p90: rank 9 of 10; 8 at or under 0.25 s, 10 under 5 s: 2.5 + 2.5 * (9 - 8) / (10 - 8).
    assert seen.ttft_ms == pytest.approx(3750)
    assert seen.mean_ttft_ms == pytest.approx((5 * 30 + 3 * 200 + 2 * 3000) / 10)
    # ITL: 40 chunks, 30 x 20 ms (bucket 0.01-0.025], 10 x 300 ms (0.25-0.5]; rank 36 falls in
    # (0.25, 0.5] holding 31..40: 0.25 + 0.25 * (36 - 30) / 10.
    assert seen.itl_ms == pytest.approx(400)
    assert seen.num_inflight == 1 and seen.num_inflight_before == 0
    # Requests came in: the load goes on, and what is in flight is the planner's floor on
    # streams; an interval in which none came, none grew and none waits: the load stopped.
    assert seen.inflight_floor == 1
    assert frontend_interval(after, parse_scrape({"frontend-0": _page(FrontendMetrics("demo"))},
                                                 time_s=130.0), model="demo").inflight_floor == 0
    assert frontend_interval(before, after, model="other").request_rate == 0


def test_arrivals_size_the_load_before_any_of_it_is_answered() -> None:
    metrics = FrontendMetrics("demo")
    for _ in range(6):
        _serve(metrics, 0.01, [], isl=200, osl=10)
    pages = [_page(metrics)]
    for _ in range(2):
        _serve(metrics, 0.01, [], isl=200, osl=10)
    # Then the prompts grow: 3 arrive and wait (routing, prefill), one answered since.
    waiting = [metrics.arrive(4000) for _ in range(3)]
    waiting[0].answered()
    pages.append(_page(metrics))
    before, after = (parse_scrape({"frontend-0": page}, t) for page, t in zip(pages, (0, 10)))
    seen = frontend_interval(before, after, model="demo")
    # Counted at the first token and at the end: 2 requests, ISL 200.
    assert seen.request_rate == pytest.approx(2 / 10) and seen.mean_isl == pytest.approx(200)
    # Counted as they arrived: 5 generations, ISL (2 x 200 + 3 x 4000) / 5.
    assert seen.arrival_rate == pytest.approx(5 / 10)
    assert seen.mean_arrival_isl == pytest.approx(2480)
    assert (seen.sizing_rate, seen.sizing_isl) == (seen.arrival_rate, seen.mean_arrival_isl)
    assert seen.queued_prompt_tokens == 8000 and seen.queued_generations == 2
    # Answered once only, whichever way it ends.
    waiting[0].answered()
    assert frontend_interval(before, parse_scrape({"frontend-0": _page(metrics)}, 10.0),
                             "demo").queued_prompt_tokens == 8000
    # A frontend that does not count arrivals (an older one): first tokens and finished
    # requests, as before.
    older = [parse_scrape({"frontend-0": "\n".join(
        line for line in page.splitlines()
        if "arrival" not in line and "queued_prompt" not in line) + "\n"}, t)
        for page, t in zip(pages, (0, 10))]
    seen = frontend_interval(*older, model="demo")
    assert seen.request_rate == pytest.approx(2 / 10)
    assert seen.arrival_rate is None
    # ... and so is every frontend while one does not count them (a rolling upgrade).
    mixed = [parse_scrape({"new": page, "old": _page(FrontendMetrics("demo")).replace(
        "arrival", "other")}, t) for page, t in zip(pages, (0, 10))]
    assert frontend_interval(*mixed, model="demo").arrival_rate is None and seen.mean_arrival_isl is None
    assert seen.queued_prompt_tokens == 0
    assert (seen.sizing_rate, seen.sizing_isl) == (seen.request_rate, seen.mean_isl)


def test_what_is_in_flight_is_a_floor_while_the_load_goes_on() -> None:
    """A closed-loop load stalled on a pool too small for it: its 3 users all wait (1 for a
    first token), so nothing arrives and nothing grows, yet the load goes on: floor 3. Once
    the one waiting is answered and nothing more arrives, the load stopped (the 2 left are
    streams running out): no floor."""
    metrics = FrontendMetrics("demo")
    users = [(metrics.track("chat_completions"), metrics.arrive(100)) for _ in range(3)]
    for tracker, queued in users[1:]:  # answered: the pipeline's share and the route's
        queued.answered()
        tracker.first_token()
    stalled = parse_scrape({"f": _page(metrics)}, 0)
    again = parse_scrape({"f": _page(metrics)}, 10)
    seen = frontend_interval(stalled, again)
    assert seen.sizing_rate == 0 and seen.num_queued == 1 and seen.inflight_floor == 3
    users[0][1].answered()  # the route's share is in finish
    users[0][0].finish("200", Usage(prompt_tokens=100, completion_tokens=1))
    assert frontend_interval(again, parse_scrape({"f": _page(metrics)}, 20)).inflight_floor == 0


def test_an_interval_without_traffic_has_no_means() -> None:
    metrics = FrontendMetrics("demo")
    _serve(metrics, 0.1, [0.01], isl=10, osl=2)
    page = _page(metrics)
    seen = frontend_interval(parse_scrape({"f": page}, 0), parse_scrape({"f": page}, 30))
    assert seen.request_rate == 0 and seen.num_finished == 0
    assert seen.mean_isl is None and seen.ttft_ms is None and seen.itl_ms is None
    with pytest.raises(ValueError):
        frontend_interval(parse_scrape({"f": page}, 30), parse_scrape({"f": page}, 30))


def test_frontend_processes_add_up_and_a_restart_counts_from_zero() -> None:
    a, b = FrontendMetrics("demo"), FrontendMetrics("demo")
    for _ in range(5):
        _serve(a, 0.1, [], isl=10, osl=1)
    for _ in range(7):
        _serve(b, 0.1, [], isl=10, osl=1)
    before = parse_scrape({"f0": _page(a), "f1": _page(b)}, 0)
    for _ in range(2):
        _serve(a, 0.1, [], isl=10, osl=1)
    restarted = FrontendMetrics("demo")  # f1 restarted: 3 requests since, fewer than before
    for _ in range(3):
        _serve(restarted, 0.1, [], isl=10, osl=1)
    late = FrontendMetrics("demo")  # f2 started within the interval
    _serve(late, 0.1, [], isl=10, osl=1)
    after = parse_scrape({"f0": _page(a), "f1": _page(restarted), "f2": _page(late)}, 10)
    assert counter_increase(before, after, "tandem_frontend_requests") == 2 + 3 + 1
    assert frontend_interval(before, after).request_rate == pytest.approx(0.6)


def test_a_restart_with_more_requests_than_before_is_caught_by_created() -> None:
    old, new = FrontendMetrics("demo"), FrontendMetrics("demo")
    _serve(old, 0.1, [], isl=10, osl=1)
    for _ in range(4):
        _serve(new, 0.1, [], isl=10, osl=1)
    before, after = parse_scrape({"f": _page(old)}, 0), parse_scrape({"f": _page(new)}, 10)
    assert counter_increase(before, after, "tandem_frontend_requests") == 4
    ttft = histogram_increase(before, after, "tandem_frontend_time_to_first_token_seconds")
    assert ttft.count == 4


def test_quantile_rules() -> None:
    h = HistogramDelta(((0.1, 2.0), (1.0, 2.0), (float("inf"), 10.0)), count=10, sum=50)
    assert h.quantile(0.1) == pytest.approx(0.05)   # the first bucket starts at 0
    assert h.quantile(0.9) == 1.0                   # in +Inf: the highest finite bound
    assert h.mean == 5
    assert HistogramDelta(((1.0, 0.0), (float("inf"), 0.0)), 0, 0).quantile(0.5) is None
    with pytest.raises(ValueError):
        h.quantile(0)


def test_worker_and_pool_loads() -> None:
    def stats(running: int, waiting: int, used: int) -> EngineStats:
        return EngineStats(num_running=running, num_waiting=waiting, kv_blocks_used=used,
                           kv_blocks_total=100, pending_prefill_tokens=0,
                           active_decode_blocks=0, prefix_cache_hit_rate=0.0)

    pages = {}
    for i, snapshot in enumerate([stats(4, 0, 50), stats(8, 2, 90), stats(1, 0, 10)]):
        worker = WorkerMetrics(f"127.0.0.1:92{i:02d}", functools.partial(_same, snapshot),
                               "decode")
        pages[f"w{i}"] = generate_latest(worker.registry).decode()
    scrape = parse_scrape(pages, 0)
    loads = worker_loads(scrape)
    assert sorted(loads) == ["127.0.0.1:9200", "127.0.0.1:9201", "127.0.0.1:9202"]
    assert loads["127.0.0.1:9201"].num_waiting == 2 and loads["127.0.0.1:9201"].kv_usage == 0.9
    pools = pool_loads(scrape, {"decode": ["127.0.0.1:9200", "127.0.0.1:9201", "gone:1"],
                                "prefill": ["127.0.0.1:9202"], "empty": []})
    assert pools["decode"].num_reporting == 2
    assert pools["decode"].mean_running == 6 and pools["decode"].mean_kv_usage == pytest.approx(0.7)
    assert pools["prefill"].mean_running == 1
    assert pools["empty"].num_reporting == 0 and pools["empty"].mean_kv_usage is None


def test_healthy_workers_per_pool_from_the_routers() -> None:
    replicas = [RouterMetrics(), RouterMetrics()]
    replicas[0].healthy_workers.labels("prefill").set(2)
    replicas[0].healthy_workers.labels("decode").set(3)
    replicas[1].healthy_workers.labels("decode").set(4)  # this replica sees one more already
    scrape = parse_scrape({f"r{i}": generate_latest(r.registry).decode()
                           for i, r in enumerate(replicas)}, 0)
    assert healthy_workers(scrape) == {"prefill": 2, "decode": 4}
