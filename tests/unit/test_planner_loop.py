"""The planner's loop over the pages the real metric objects write (the frontend's, the router's)
and a recorded connector: it decides only on complete intervals, grows and shrinks through the
connector naming the cheapest workers first, starts from the deployment as it finds it, splits
the traffic between pools of one role, and reports what it decided and why."""
from __future__ import annotations

import asyncio
import json
import pathlib
import time
from collections.abc import Sequence

import pytest
from prometheus_client import generate_latest

from tandem.engines.types import Usage
from tandem.frontend.metrics import FrontendMetrics
from tandem.planner.config import planner_config_from_dict
from tandem.planner.connector import Connector
from tandem.planner.demand import PoolModel
from tandem.planner.exposition import parse_scrape
from tandem.planner.loop import PlannerLoop, routed_shares
from tandem.planner.metrics import PlannerMetrics
from tandem.planner.profile import profile_from_dict
from tandem.planner.removal import RemovalCost, pool_workers, removal_order
from tandem.planner.report import ReportWriter, format_report, read_report
from tandem.planner.scrape import Round
from tandem.routing.metrics import RouterMetrics

FRONTEND, ROUTER = "http://f/metrics", "http://r/metrics"
#: 4 streams per worker within ITL 20 ms; prefill all but free: r req/s of OSL 50 need r / 4
#: workers (and a few millionths for the prompts).
PROFILE = profile_from_dict({
    "version": 1, "engine": "mock", "model": "t", "gpus_per_worker": 1,
    "prefill": [{"isl": 1, "tokens_per_s": 1e6, "ttft_ms": 1}],
    "decode": [{"context_length": 1, "batch_size": 1, "itl_ms": 5},
               {"context_length": 1, "batch_size": 10, "itl_ms": 50}]})


class Pages:
    """A frontend and a router whose pages the fake scraper reads, on a fake clock."""

    def __init__(self) -> None:
        self.frontend = FrontendMetrics("demo")
        self.router = RouterMetrics()
        self.workers: dict[str, tuple[str, int, int]] = {}
        self.router.watch_index(lambda: self.workers)
        self.urls = [FRONTEND, ROUTER]
        self.now = 0.0
        self.down: set[str] = set()

    def serve(self, requests: int, osl: int = 50, isl: int = 4, ttft_s: float = 0.01) -> None:
        for _ in range(requests):  # as the frontend's pipeline counts them
            tracker = self.frontend.track("completions")
            queued = self.frontend.arrive(isl)
            self.frontend.observe_chunk(ttft_s, 0.0, 1)
            queued.answered()
            tracker.finish("200", Usage(prompt_tokens=isl, completion_tokens=osl))

    async def round(self) -> Round:
        pages = {FRONTEND: self.frontend.render().decode(),
                 ROUTER: generate_latest(self.router.registry).decode()}
        scrape = parse_scrape({u: t for u, t in pages.items() if u not in self.down}, self.now)
        self.now += 2.0
        return Round(scrape, {u: "down" for u in self.down})


class Recorded(Connector):
    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.calls: list[tuple[str, int, list[str]]] = []

    async def actual(self) -> dict[str, int]:
        return dict(self.sizes)

    async def scale(self, pool: str, target: int, remove: Sequence[str] = ()) -> None:
        self.calls.append((pool, target, list(remove)))
        self.sizes[pool] = target


def planner(pages: Pages, connector: Connector, report: ReportWriter | None = None,
            **plan: object) -> PlannerLoop:
    config = planner_config_from_dict({
        "interval_s": 2, "correction_alpha": 0, "predictor_window": 1, "pools": [
            {"name": "decode", "role": "agg", "ttft_target_ms": 1000, "itl_target_ms": 20,
             "max_workers": 4}], **plan})
    return PlannerLoop(config, {p.name: PoolModel(PROFILE) for p in config.pools}, connector,
                       pages, [FRONTEND], PlannerMetrics(), report)  # type: ignore[arg-type]


async def test_it_grows_a_pool_under_load_and_shrinks_it_cheapest_worker_first(
        tmp_path: pathlib.Path) -> None:
    pages, connector = Pages(), Recorded({"decode": 1})
    report = ReportWriter(str(tmp_path / "status.json"), 2.0)
    loop = planner(pages, connector, report)
    assert await loop.step() is None  # the first round is the baseline
    pages.serve(22)  # 11 req/s x OSL 50 x 20 ms = 11 streams, 4 per worker: 2.75 workers
    decision = await loop.step()
    assert decision is not None and decision.targets() == {"decode": 3}
    assert connector.calls == [("decode", 3, [])]
    body = read_report(str(tmp_path / "status.json"))
    assert body is not None and body["targets"] == {"decode": 3}
    assert body["decisions"][-1]["pools"][0]["reason"].startswith("scale up 1 -> 3")
    assert "decode 1 (target 3)" in format_report(body)  # as it was when it decided
    # Idle: after the scale-down window (2 intervals) and the cooldown (2), back to 1; the
    # connector is told to remove the workers holding the fewest cached blocks first.
    pages.workers = {"127.0.0.1:1": ("decode", 50, 0), "127.0.0.1:2": ("decode", 5, 0),
                     "127.0.0.1:3": ("decode", 5, 1)}
    targets = [(await loop.step()).targets()["decode"] for _ in range(4)]  # type: ignore[union-attr]
    assert targets == [3, 3, 1, 1]
    assert connector.calls[-1] == ("decode", 1, ["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:1"])


async def test_an_interval_without_the_frontend_page_is_not_decided_on() -> None:
    pages, connector = Pages(), Recorded({"decode": 1})
    loop = planner(pages, connector)
    await loop.step()
    pages.down = {FRONTEND}
    pages.serve(24)
    assert await loop.step() is None and connector.calls == []
    pages.down = set()
    # The next complete round is compared with the last complete one: 24 requests over 4 s.
    decision = await loop.step()
    assert decision is not None and decision.pools[0].demand == pytest.approx(1.5, rel=1e-3)


async def test_a_restarted_planner_takes_the_deployment_as_it_finds_it() -> None:
    pages, connector = Pages(), Recorded({"decode": 3})
    loop = planner(pages, connector)
    await loop.step()
    pages.serve(17)  # 8.5 req/s: 2.1 workers' worth, 2.6 with the 20% headroom: keep 3
    decision = await loop.step()
    assert decision is not None and decision.pools[0].previous == 3
    assert decision.targets() == {"decode": 3} and connector.calls == []


def test_traffic_splits_between_pools_of_a_role_by_the_routers_decisions() -> None:
    config = planner_config_from_dict({"pools": [
        {"name": "fast", "role": "decode", "itl_target_ms": 10},
        {"name": "slow", "role": "decode", "itl_target_ms": 50},
        {"name": "prefill", "role": "prefill", "ttft_target_ms": 500}]})
    router = RouterMetrics()
    before = parse_scrape({ROUTER: generate_latest(router.registry).decode()}, 0)
    for pool, count in (("fast", 3), ("slow", 1)):
        for _ in range(count):
            router.decisions.labels(pool, "w").inc()
    after = parse_scrape({ROUTER: generate_latest(router.registry).decode()}, 2)
    assert routed_shares(config, before, after) == {"fast": 0.75, "slow": 0.25, "prefill": 1.0}
    assert routed_shares(config, after, after)["fast"] == 0.5  # no decision: equal shares


def test_removal_reads_each_pools_workers_from_the_router_page() -> None:
    router = RouterMetrics()
    router.watch_index(lambda: {"a:1": ("decode", 10, 2), "b:1": ("decode", 10, 0),
                                "c:1": ("prefill", 0, 0)})
    workers = pool_workers(parse_scrape({ROUTER: generate_latest(router.registry).decode()},
                                        0))
    assert workers["decode"] == {"a:1": RemovalCost(10, 2), "b:1": RemovalCost(10, 0)}
    assert removal_order(workers["decode"]) == ["b:1", "a:1"]
    assert list(workers["prefill"]) == ["c:1"]


def test_the_report_is_json_a_person_can_read(tmp_path: pathlib.Path) -> None:
    writer = ReportWriter(str(tmp_path / "r.json"), 30.0)
    writer.note("took its first metrics")
    body = json.loads((tmp_path / "r.json").read_text())
    assert body["note"] == "took its first metrics" and body["decisions"] == []
    assert "no decision yet" in format_report(body)
    assert read_report(str(tmp_path / "missing.json")) is None


async def test_a_backlog_grows_the_pool_between_intervals(tmp_path: pathlib.Path) -> None:
    """Requests pile up in flight after an interval sized the pool for 2 req/s: the backlog
    check grows it to what they need (10 in flight, 4 streams per worker: 3) at once, says so
    in the report and the metrics, and does not grow it again for the same backlog; the next
    interval keeps it (its in-flight floor sees the same requests)."""
    pages, connector = Pages(), Recorded({"decode": 1})
    report = ReportWriter(str(tmp_path / "status.json"), 2.0)
    loop = planner(pages, connector, report, scale_up_check_s=0.5)
    await loop.step()
    assert await loop.check_backlog() is None  # nothing decided yet: no load to size from
    pages.serve(4)  # 2 req/s x OSL 50 x 20 ms = 2 streams: 1 worker
    decision = await loop.step()
    assert decision is not None and decision.targets() == {"decode": 1}
    queued = [pages.frontend.track("completions") for _ in range(3)]
    assert await loop.check_backlog() is None and connector.calls == []  # 1 worker holds 3
    queued += [pages.frontend.track("completions") for _ in range(7)]
    fast = await loop.check_backlog()
    assert fast is not None and fast.fast and fast.targets() == {"decode": 3}
    assert connector.calls == [("decode", 3, [])]
    body = read_report(str(tmp_path / "status.json"))
    assert body is not None and body["decisions"][-1]["fast"] is True
    assert "fast scale-up after interval 0: decode 1 -> 3" in format_report(body)
    assert loop.metrics.registry.get_sample_value(
        "tandem_planner_fast_scale_ups_total", {"pool": "decode"}) == 1
    assert await loop.check_backlog() is None and len(connector.calls) == 1
    decision = await loop.step()
    assert decision is not None and decision.targets() == {"decode": 3}
    assert decision.pools[0].reason.startswith("steady at 3")
    for tracker in queued:
        tracker.finish("200", Usage(prompt_tokens=4, completion_tokens=50))


#: Prefill at ISL 4,000: 4,000 tok/s per worker within TTFT 1 s (1,000 within 100 ms); ten
#: times that at ISL 10. Decode as PROFILE.
PREFILL_PROFILE = profile_from_dict({
    "version": 1, "engine": "mock", "model": "t", "gpus_per_worker": 1,
    "prefill": [{"isl": 10, "tokens_per_s": 10000, "ttft_ms": 100},
                {"isl": 10, "tokens_per_s": 40000, "ttft_ms": 1000},
                {"isl": 4000, "tokens_per_s": 1000, "ttft_ms": 100},
                {"isl": 4000, "tokens_per_s": 4000, "ttft_ms": 1000}],
    "decode": [{"context_length": 1, "batch_size": 1, "itl_ms": 5},
               {"context_length": 1, "batch_size": 10, "itl_ms": 50}]})


def disagg_planner(pages: Pages, connector: Connector, alpha: float = 0) -> PlannerLoop:
    config = planner_config_from_dict({
        "interval_s": 2, "correction_alpha": alpha, "predictor_window": 1, "pools": [
            {"name": "prefill", "role": "prefill", "ttft_target_ms": 1000, "max_workers": 8},
            {"name": "decode", "role": "decode", "itl_target_ms": 20, "max_workers": 8}]})
    return PlannerLoop(config, {p.name: PoolModel(PREFILL_PROFILE) for p in config.pools},
                       connector, pages, [FRONTEND], PlannerMetrics())  # type: ignore[arg-type]


async def test_longer_prompts_waiting_grow_the_prefill_pool_between_intervals() -> None:
    """The ISL shift under a closed-loop load: as many requests in flight as at the last
    decision (each stream sends its next when its last ends), but their prompts are now 4,000
    tokens, not 10, and wait for their first token. The prompt tokens waiting grew: the check
    sizes prefill from them at once, at their own length (16,000 within TTFT 1 s over 4,000
    tok/s per worker at ISL 4,000: 4; at the last interval's ISL 10, 0.4), and decode keeps
    the four streams they will become."""
    pages, connector = Pages(), Recorded({"prefill": 1, "decode": 1})
    loop = disagg_planner(pages, connector)
    await loop.step()
    waiting = [(pages.frontend.track("completions"), pages.frontend.arrive(10))
               for _ in range(4)]
    assert (await loop.step()).targets() == {"prefill": 1, "decode": 1}  # type: ignore[union-attr]
    assert await loop.check_backlog() is None  # nothing grew
    for tracker, queued in waiting:  # answered; the streams' next requests arrive
        queued.answered()
        tracker.finish("200", Usage(prompt_tokens=10, completion_tokens=50))
    waiting = [(pages.frontend.track("completions"), pages.frontend.arrive(4000))
               for _ in range(4)]
    fast = await loop.check_backlog()
    assert fast is not None and fast.targets() == {"prefill": 4, "decode": 1}
    assert "16000 waiting for a first token at ISL 4000" in fast.pools[0].reason
    assert connector.calls == [("prefill", 4, [])]


async def test_a_ttft_that_measured_a_queue_does_not_correct_the_profile() -> None:
    """TTFT p90 of 3 s where the profile predicts ~100 ms: the workers are slower than their
    profile, and the model learns it, unless the interval ended with prompts waiting beyond
    what the pool answers within its target (2 x 4,000 tok/s x 1 s here): that TTFT measured
    the queue."""
    pages = Pages()
    loop = disagg_planner(pages, Recorded({"prefill": 1, "decode": 1}), alpha=0.5)
    await loop.step()
    pages.serve(4, isl=1000, ttft_s=3.0)  # 2 req/s x ISL 1000: 2,000 tok/s, 2,000 in a TTFT
    waiting = [pages.frontend.arrive(4000) for _ in range(4)]  # 16,000 tokens waiting
    await loop.step()
    assert loop.models["prefill"].prefill.factor == 1.0
    for queued in waiting:
        queued.answered()
    pages.serve(4, isl=1000, ttft_s=3.0)
    await loop.step()
    assert loop.models["prefill"].prefill.factor > 1.0


async def test_a_queue_the_backlog_check_saw_drain_before_the_interval_end_still_counts() -> None:
    """Prompts leave the waiting gauge once prefilled: a queue built and drained within an
    interval shows only to the backlog checks between its ends. Its peak (16,000 tokens
    waiting, past the 2,000 the pool answers within its target) keeps the interval's TTFT out
    of the prefill profile, though the interval ended with none waiting; the peak is the
    interval's own, so the next slow interval without a queue corrects the profile."""
    pages = Pages()
    loop = disagg_planner(pages, Recorded({"prefill": 1, "decode": 1}), alpha=0.5)
    await loop.step()
    await loop.step()  # nothing served: decided, nothing to correct from
    pages.serve(4, isl=1000, ttft_s=3.0)  # 2 req/s x ISL 1000: 2,000 tokens in a TTFT
    waiting = [pages.frontend.arrive(4000) for _ in range(4)]
    await loop.check_backlog()  # sees 16,000 tokens waiting
    for queued in waiting:
        queued.answered()  # the interval ends with none waiting
    await loop.step()
    assert loop.models["prefill"].prefill.factor == 1.0
    pages.serve(4, isl=1000, ttft_s=3.0)
    await loop.step()
    assert loop.models["prefill"].prefill.factor > 1.0


async def test_the_loop_checks_the_backlog_between_its_intervals() -> None:
    """run() itself: a backlog that appears after the first decision is met by a check before
    the next interval (an hour away), and a check that is not shorter than the interval never
    runs."""
    pages, connector = Pages(), Recorded({"decode": 1})
    loop = planner(pages, connector, interval_s=3600, scale_up_check_s=0.05)
    await loop.step()
    pages.serve(4)
    await loop.step()
    for _ in range(10):
        pages.frontend.track("completions")  # in flight, never finished
    stop = asyncio.Event()
    task = asyncio.create_task(loop._between(stop, time.monotonic() + 3600))
    for _ in range(400):
        if connector.calls:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    assert connector.calls == [("decode", 3, [])]
    slow = planner(Pages(), Recorded({"decode": 1}), interval_s=2, scale_up_check_s=2)
    slow.check_backlog = None  # type: ignore[assignment,method-assign]  # a call would raise
    await slow._between(asyncio.Event(), time.monotonic() + 0.1)
