"""The planner's loop: every interval, scrape -> observe -> refine -> predict -> decide -> act.

Why the services' Prometheus pages and not the router's event stream: the load the pools are
sized for (request rate, prompt and output lengths, TTFT and ITL as clients see them) is
measured only at the frontends, which have no stream; the router's page adds each pool's
workers with the KV blocks and requests on each (what removing one would cost), from the
streams the router already follows. Counters live in the services, so a restarted planner
resumes from them after one interval, with nothing of its own to recover; and the planner needs
nothing from the services that Prometheus does not already scrape.

An interval is decided only on complete frontend data: a round in which a frontend's page did
not answer is skipped, and the next complete round is compared with the last complete one (a
page missing from one round would otherwise count its counters' whole values as new traffic).

Between decisions, every `scale_up_check_s`, a backlog check reads the pages again: when the
frontends' requests in flight, or the prompt tokens waiting for a first token, are more than at the
last decision, the last interval's load with them as its floors (tandem.planner.demand) is put to
the decider's fast scale-up (Decider.scale_up_now), which grows a pool whose workers cannot hold
them (by more than the scale-down headroom). A step burst is so met within seconds, not at the next
interval; the interval decisions stay the only ones that shrink a pool.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

from tandem.errors import TandemError
from tandem.planner.config import PlannerConfig, PlannerPoolConfig
from tandem.planner.connector import Connector
from tandem.planner.decision import Decider, Decision
from tandem.planner.demand import PoolModel, concurrent_streams
from tandem.planner.exposition import Scrape, counter_increase
from tandem.planner.metrics import PlannerMetrics
from tandem.planner.observe import (
    FrontendInterval,
    PoolLoad,
    frontend_interval,
    inflight_requests,
    pool_loads,
    queued_load,
)
from tandem.planner.predictor import Load, LoadPredictor
from tandem.planner.removal import RemovalCost, pool_workers, removal_order
from tandem.planner.report import ReportWriter
from tandem.planner.scrape import Scraper

log = logging.getLogger("tandem.planner")
ROUTER_DECISIONS = "tandem_router_decisions"


class PlannerLoop:
    """Runs the plan against one deployment. Keeps only what the next interval needs (the last
    complete scrape, the predictor's window, the decider's hysteresis, the models' online
    corrections); losing it costs one interval and resets hysteresis, nothing else."""

    def __init__(self, plan: PlannerConfig, models: Mapping[str, PoolModel],
                 connector: Connector, scraper: Scraper, frontend_urls: Sequence[str],
                 metrics: PlannerMetrics, report: ReportWriter | None = None,
                 model_name: str | None = None) -> None:
        self.plan = plan
        self.models = dict(models)
        self.connector = connector
        self.scraper = scraper
        self.frontend_urls = list(frontend_urls)
        self.metrics = metrics
        self.report = report
        self.model_name = model_name
        self.predictor = LoadPredictor(plan.predictor_window)
        self.decider: Decider | None = None
        self._baseline: Scrape | None = None
        #: The last decided interval's load (before the pools' shares) and the shares.
        self._last_load: Load | None = None
        self._shares: dict[str, float] = {}
        #: The most prompt tokens the backlog checks saw waiting since the last complete round.
        self._peak_queued_tokens = 0.0
        #: Pages that answered at least once, and those not answering now (for the log).
        self._answered: set[str] = set()
        self._down: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Steps every interval_s, and checks the backlog every scale_up_check_s between steps,
        until `stop` is set."""
        while not stop.is_set():
            deadline = time.monotonic() + self.plan.interval_s
            try:
                await self.step()
            except TandemError as exc:  # the connector or a profile: say so, try next time
                log.warning("interval not planned", extra={"error": exc.message})
                self._note(f"not planned: {exc.message}")
            await self._between(stop, deadline)

    async def _between(self, stop: asyncio.Event, deadline: float) -> None:
        """Backlog checks until `deadline` (none when the next would come after it)."""
        check = self.plan.scale_up_check_s
        while not stop.is_set():
            left = deadline - time.monotonic()
            wait = check if 0 < check < left else max(left, 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if wait == left or wait <= 0 or stop.is_set():
                return
            try:
                await self.check_backlog()
            except TandemError as exc:
                log.warning("backlog check failed", extra={"error": exc.message})

    async def check_backlog(self) -> Decision | None:
        """One backlog check (module docstring); the fast scale-up it made, or None."""
        if self.decider is None or self._baseline is None or self._last_load is None:
            return None  # nothing decided yet: no load to size from
        round_ = await self.scraper.round()
        if round_.missing_any(self.frontend_urls):
            return None
        before = inflight_requests(self._baseline, self.model_name)
        now = inflight_requests(round_.scrape, self.model_name)
        queued, queued_tokens = queued_load(round_.scrape, self.model_name)
        self._peak_queued_tokens = max(self._peak_queued_tokens, queued_tokens)
        if now <= before and queued_tokens <= queued_load(self._baseline, self.model_name)[1]:
            return None
        load = dataclasses.replace(self._last_load, inflight=now, queued=queued,
                                   queued_prompt_tokens=queued_tokens)
        decision = self.decider.scale_up_now(
            {p.name: _scaled(load, self._shares.get(p.name, 1.0)) for p in self.plan.pools},
            self.models)
        if decision is None:
            return None
        actual = await self.connector.actual()
        for pool in decision.pools:
            if pool.is_change:
                log.info(f"{pool.pool}: {pool.reason}", extra={
                    "pool": pool.pool, "after_interval": decision.interval - 1,
                    "actual": actual.get(pool.pool), "target": pool.target,
                    "demand": round(pool.demand, 3), "inflight": now,
                    "inflight_at_decision": before})
        self.metrics.observe(decision, load, actual)
        await self._act(decision, actual, pool_workers(round_.scrape))
        if self.report is not None:
            self.report.record(decision, load, actual)
        return decision

    async def step(self) -> Decision | None:
        """One interval; the decision, or None when the interval could not be decided on."""
        round_ = await self.scraper.round()
        self._log_pages(round_.failed)
        if round_.missing_any(self.frontend_urls):
            self.metrics.skipped.inc()
            self._note("skipped: a frontend's metrics page did not answer")
            return None
        before, after = self._baseline, round_.scrape
        self._baseline = after
        peak_queued_tokens, self._peak_queued_tokens = self._peak_queued_tokens, 0.0
        if before is None:
            self._note("took its first metrics; decides after one interval")
            return None
        seen = frontend_interval(before, after, self.model_name)
        self.predictor.observe(seen.sizing_rate, seen.sizing_isl, seen.mean_osl)
        predicted = self.predictor.predict()
        assert predicted is not None  # observed one above
        load = dataclasses.replace(predicted, inflight=seen.inflight_floor,
                                   queued=seen.queued_generations,
                                   queued_prompt_tokens=seen.queued_prompt_tokens)
        self._last_load = predicted
        actual = await self.connector.actual()
        if self.decider is None:  # a (re)started planner takes the deployment as it is
            self.decider = Decider(self.plan, actual)
        workers = pool_workers(after)
        shares = self._shares = routed_shares(self.plan, before, after)
        self._refine(seen, max(peak_queued_tokens, seen.queued_prompt_tokens), actual, workers,
                     shares)
        decision = self.decider.decide(
            {p.name: _scaled(load, shares[p.name]) for p in self.plan.pools}, self.models)
        seen_load = pool_loads(after, {name: list(w) for name, w in workers.items()})
        for pool in decision.pools:
            log.info(f"{pool.pool}: {pool.reason}", extra={
                "pool": pool.pool, "interval": decision.interval, "actual": actual.get(pool.pool),
                "target": pool.target, "demand": round(pool.demand, 3),
                **_worker_gauges(seen_load.get(pool.pool))})
        self.metrics.observe(decision, load, actual)
        await self._act(decision, actual, workers)
        if self.report is not None:
            self.report.record(decision, load, actual)
        return decision

    def _refine(self, seen: FrontendInterval, peak_queued_tokens: float,
                actual: Mapping[str, int], workers: Mapping[str, Mapping[str, RemovalCost]],
                shares: Mapping[str, float]) -> None:
        """Each pool's model corrected by what its workers showed this interval. Not the
        prefill side of an interval in which more prompt tokens waited than the pool took within
        its TTFT target (at the rate it answered them): its TTFT is that queue's, which the floor
        on waiting tokens sizes for, not the workers' speed (taken for it, a burst of long
        prompts made the profile's lightest load miss the target). `peak_queued_tokens` is the
        most seen waiting, by the backlog checks or at the interval's end: prompts leave the
        gauge once prefilled, so a queue built during the interval has often drained by its
        end."""
        alpha = self.plan.correction_alpha
        for pool in self.plan.pools:
            num = actual.get(pool.name, 0)
            share = shares[pool.name]
            rate = seen.request_rate * share
            if not alpha or num <= 0 or rate <= 0 or seen.mean_isl is None:
                continue
            model = self.models[pool.name]
            answered = rate * seen.mean_isl * pool.ttft_target_ms / 1000
            if pool.uses_prefill and seen.ttft_ms is not None \
                    and peak_queued_tokens * share <= answered:
                model = model.refined_prefill(seen.mean_isl, rate * seen.mean_isl / num,
                                              seen.ttft_ms, alpha)
            if pool.uses_decode and seen.itl_ms is not None and seen.mean_osl is not None:
                model = model.refined_decode(seen.mean_isl + seen.mean_osl / 2,
                                             _streams_per_worker(pool, seen, rate, num, workers),
                                             seen.itl_ms, alpha)
            self.models[pool.name] = model

    async def _act(self, decision: Decision, actual: Mapping[str, int],
                   workers: Mapping[str, Mapping[str, RemovalCost]]) -> None:
        for pool in decision.pools:
            have = actual.get(pool.pool)
            if have is None:
                log.warning("the connector has no such pool", extra={"pool": pool.pool})
                continue
            if pool.target == have:
                continue
            remove = removal_order(dict(workers.get(pool.pool, {}))) if pool.target < have \
                else []
            try:
                await self.connector.scale(pool.pool, pool.target, remove)
            except TandemError as exc:
                self.metrics.scale_errors.labels(pool.pool).inc()
                log.warning("scale call failed", extra={"pool": pool.pool, "target": pool.target,
                                                        "error": exc.message})

    def _log_pages(self, failed: Mapping[str, str]) -> None:
        """One line per outage of a page, not one per round: at debug for a page that never
        answered (its service is still starting), else a warning; and one when it is back."""
        for url, why in failed.items():
            self.metrics.scrape_failures.labels(url).inc()
            if url not in self._down:
                self._down.add(url)
                log.log(logging.WARNING if url in self._answered else logging.DEBUG,
                        "metrics page did not answer", extra={"url": url, "error": why})
        for url in self._down - set(failed):
            if url in self._answered:
                log.info("metrics page answers again", extra={"url": url})
        self._down &= set(failed)
        self._answered |= set(self.scraper.urls) - set(failed)

    def _note(self, text: str) -> None:
        if self.report is not None:
            self.report.note(text)


def routed_shares(plan: PlannerConfig, before: Scrape, after: Scrape) -> dict[str, float]:
    """Each pool's share of the traffic: 1 for a pool alone in its role; with several pools of
    one role (the router's SLA grid splits the traffic), their shares of the router's decisions
    in the interval, equal when it made none."""
    shares: dict[str, float] = {}
    for role in {p.role for p in plan.pools}:
        pools = [p for p in plan.pools if p.role == role]
        routed = {p.name: counter_increase(before, after, ROUTER_DECISIONS, {"pool": p.name})
                  for p in pools}
        total = sum(routed.values())
        for p in pools:
            shares[p.name] = 1.0 if len(pools) == 1 else (
                routed[p.name] / total if total > 0 else 1 / len(pools))
    return shares


def _worker_gauges(load: PoolLoad | None) -> dict[str, float]:
    """The pool's workers' own gauges, where their pages were scraped (worker_metrics_urls)."""
    if load is None or not load.num_reporting:
        return {}
    gauges = {"mean_running": round(load.mean_running, 2),
              "mean_waiting": round(load.mean_waiting, 2)}
    if load.mean_kv_usage is not None:
        gauges["mean_kv_usage"] = round(load.mean_kv_usage, 3)
    return gauges


def _scaled(load: Load, share: float) -> Load:
    return load if share == 1.0 else Load(
        load.request_rate * share, load.mean_isl, load.mean_osl, load.inflight * share,
        load.queued * share, load.queued_prompt_tokens * share)


def _streams_per_worker(pool: PlannerPoolConfig, seen: FrontendInterval, rate: float, num: int,
                        workers: Mapping[str, Mapping[str, RemovalCost]]) -> float:
    """Streams each worker decoded: the router's count of requests on the pool's workers where
    its page lists them, else Little's law at the observed ITL."""
    listed = workers.get(pool.name)
    if listed:
        return sum(c.active_requests for c in listed.values()) / len(listed)
    assert seen.itl_ms is not None and seen.mean_isl is not None and seen.mean_osl is not None
    return concurrent_streams(Load(rate, seen.mean_isl, seen.mean_osl), seen.itl_ms) / num
