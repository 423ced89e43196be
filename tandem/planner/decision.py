"""Each interval's decision: the workers each pool should have, and why.

Per pool, in the order of the config:

1. **Demand** (tandem.planner.demand): the fractional workers the predicted load needs.
2. **Bounds**: wanted = ceil(demand) within [min_workers, max_workers].
3. **Hysteresis** (HysteresisConfig): more workers are granted at once. Fewer only when each of
   the last `scale_down_intervals` intervals wanted fewer than the pool has, counting demand
   with `scale_down_headroom` added, and not within `cooldown_intervals` decisions after a
   scale-up; the pool then shrinks to the most any of those intervals wanted.
4. **GPU budget**, over all pools: while the targets hold more GPUs than `gpu_budget`, one
   worker is taken from the pool whose target most exceeds its demand (the highest target /
   demand; a pool with no demand first, one whose target is unreachable last), never below
   its min_workers; ties go to the pool with more GPUs per worker, then to the pool listed
   later in the config. Taking from the most over-served pool each time keeps every pool's
   share of the GPUs close to its share of the demand: with prefill demanding 6 workers and
   decode 2 under a budget of 4, prefill keeps 3 and decode 1. The budget may shrink a pool
   that hysteresis was holding: a held worker gives way to one the load needs.

Between intervals, `scale_up_now` only grows (fast up, slow down, as Kubernetes' HPA and KEDA
do): the loop passes the load of the last interval with the requests in flight and waiting for
a first token now (and their prompt tokens), and a pool whose demand exceeds the workers it has
by more than `scale_down_headroom` (a backlog, not the
noise of a load at capacity: the same margin keeps an interval from shrinking a pool, so a
worker added on it is not taken away at the next chance) gets what the demand asks for at once,
within max_workers and the GPUs the budget has left (taken in the config's order; no pool is cut
for another). A fast scale-up counts as a scale-up for the cooldown, so the next interval
decisions do not shrink the pool it grew; it adds nothing to the scale-down window and is not
an interval.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.planner.config import PlannerConfig, PlannerPoolConfig
from tandem.planner.demand import Demand, PoolModel, check_model, pool_demand
from tandem.planner.predictor import Load


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    role: str
    #: Workers the pool had before this decision (the previous decision's target).
    previous: int
    #: Workers the demand asks for within min/max, before hysteresis and the budget.
    wanted: int
    #: Workers the pool should have now.
    target: int
    #: Fractional workers the predicted load needs (inf: the target is out of reach).
    demand: float
    #: Why, in words: the verdict, then how the demand was computed.
    reason: str

    @property
    def is_change(self) -> bool:
        return self.target != self.previous


@dataclass(frozen=True)
class Decision:
    #: Decisions made before this one.
    interval: int
    pools: tuple[PoolDecision, ...]
    #: GPUs the targets hold together.
    num_gpus: int
    #: A fast scale-up between intervals (Decider.scale_up_now), not an interval's decision.
    fast: bool = False

    def targets(self) -> dict[str, int]:
        return {p.pool: p.target for p in self.pools}

    def summary(self) -> str:
        """One line for the decision log and `tandem status`."""
        parts = [f"{p.pool} {p.previous} -> {p.target}" if p.is_change else f"{p.pool} {p.target}"
                 for p in self.pools]
        when = (f"fast scale-up after interval {self.interval - 1}" if self.fast else
                f"interval {self.interval}")
        return f"{when}: {', '.join(parts)}; {self.num_gpus} GPUs"


@dataclass
class _PoolState:
    workers: int
    #: Recent intervals' wanted counts with headroom (the scale-down window).
    down_wants: deque[int]
    #: Decisions since this pool last grew (large: never).
    since_scale_up: int


class Decider:
    """Turns each interval's predicted load into worker targets (see the module docstring).

    Not thread-safe: one planner loop calls `decide` once per interval.
    """

    def __init__(self, config: PlannerConfig, current: Mapping[str, int] | None = None) -> None:
        """`current`: the workers each pool has now (a restarted planner passes what it
        observes); pools missing from it start at their min_workers."""
        self.config = config
        window = config.hysteresis.scale_down_intervals
        current = current or {}
        self._states = {
            pool.name: _PoolState(_clamp(current.get(pool.name, pool.min_workers), pool),
                                  deque(maxlen=window), since_scale_up=1 << 30)
            for pool in config.pools}
        self._num_decided = 0

    def decide(self, loads: Mapping[str, Load], models: Mapping[str, PoolModel]) -> Decision:
        """The targets for the next interval. `loads` gives each pool the load predicted to
        reach it, `models` its capacity model. Raises KeyError for a pool missing from
        either, InvalidRequest for a profile that cannot size its pool."""
        verdicts: list[tuple[PlannerPoolConfig, Demand, int, int, str]] = []
        for pool in self.config.pools:
            model = models[pool.name]
            check_model(pool, model)
            demand = pool_demand(pool, model, loads[pool.name])
            wanted, target, verdict = self._hysteresis(pool, demand.workers)
            verdicts.append((pool, demand, wanted, target, verdict))
        targets = self._fit_budget({p.name: t for p, _, _, t, _ in verdicts},
                                   {p.name: d.workers for p, d, _, _, _ in verdicts})
        decisions = []
        for pool, demand, wanted, target, verdict in verdicts:
            state = self._states[pool.name]
            if targets[pool.name] < target:
                verdict += f", cut to {targets[pool.name]} to fit the GPU budget"
            decisions.append(PoolDecision(pool.name, pool.role, state.workers, wanted,
                                          targets[pool.name], demand.workers,
                                          f"{verdict}: {demand.reason}"))
            if targets[pool.name] > state.workers:
                state.since_scale_up = 0
            state.workers = targets[pool.name]
        decision = Decision(self._num_decided, tuple(decisions), self._gpus(targets))
        self._num_decided += 1
        return decision

    def scale_up_now(self, loads: Mapping[str, Load], models: Mapping[str, PoolModel]
                     ) -> Decision | None:
        """A fast scale-up between intervals (module docstring), or None when no pool's demand
        for `loads` (the last interval's load with the requests in flight and waiting now)
        exceeds its workers by more than the headroom, or none can grow. Raises as `decide`."""
        budget = self.config.gpu_budget
        free = budget - self._gpus({p: s.workers for p, s in self._states.items()}) if budget \
            else 1 << 30
        decisions, grown = [], False
        for pool in self.config.pools:
            model = models[pool.name]
            check_model(pool, model)
            demand = pool_demand(pool, model, loads[pool.name])
            state = self._states[pool.name]
            now, wanted = state.workers, _clamp(_ceil(demand.workers), pool)
            backlog = demand.workers > now * (1 + self.config.hysteresis.scale_down_headroom)
            target = min(wanted, now + max(free, 0) // pool.gpus_per_worker) \
                if backlog and wanted > now else now
            if target > now:
                verdict = f"fast scale up {now} -> {target} on the backlog"
                free -= (target - now) * pool.gpus_per_worker
                state.workers, state.since_scale_up, grown = target, 0, True
            else:
                verdict = f"steady at {now}"
            if backlog and wanted > target:
                verdict += f", short of {wanted} by the GPU budget"
            decisions.append(PoolDecision(pool.name, pool.role, now, wanted, target,
                                          demand.workers, f"{verdict}: {demand.reason}"))
        if not grown:
            return None
        targets = {p.pool: p.target for p in decisions}
        return Decision(self._num_decided, tuple(decisions), self._gpus(targets), fast=True)

    def _hysteresis(self, pool: PlannerPoolConfig, demand: float) -> tuple[int, int, str]:
        """(wanted, target before the budget, verdict) for one pool; records the interval."""
        rules = self.config.hysteresis
        state = self._states[pool.name]
        state.since_scale_up += 1
        wanted = _clamp(_ceil(demand), pool)
        state.down_wants.append(_clamp(_ceil(demand * (1 + rules.scale_down_headroom)), pool))
        now = state.workers
        if wanted > now:
            return wanted, wanted, f"scale up {now} -> {wanted}"
        highest = max(state.down_wants)
        if highest >= now:
            return wanted, now, f"steady at {now}"
        if len(state.down_wants) < rules.scale_down_intervals:
            return wanted, now, (f"hold {now}: wants {highest} for {len(state.down_wants)} of "
                                 f"{rules.scale_down_intervals} intervals")
        if state.since_scale_up <= rules.cooldown_intervals:
            return wanted, now, (f"hold {now}: wants {highest}, in the cooldown after the "
                                 f"scale-up {state.since_scale_up} interval(s) ago")
        return wanted, highest, (f"scale down {now} -> {highest}: each of the last "
                                 f"{rules.scale_down_intervals} intervals wanted at most "
                                 f"{highest}")

    def _fit_budget(self, targets: dict[str, int], demands: dict[str, float]) -> dict[str, int]:
        budget = self.config.gpu_budget
        if not budget:
            return targets
        targets = dict(targets)
        order = {pool.name: i for i, pool in enumerate(self.config.pools)}
        while self._gpus(targets) > budget:
            cuttable = [p for p in self.config.pools if targets[p.name] > p.min_workers]
            if not cuttable:  # PlannerConfig rejects a budget below the minimums
                break

            def key(pool: PlannerPoolConfig) -> tuple[float, int, int]:
                demand = demands[pool.name]
                coverage = math.inf if demand == 0 else targets[pool.name] / demand
                return coverage, pool.gpus_per_worker, order[pool.name]

            targets[max(cuttable, key=key).name] -= 1
        return targets

    def _gpus(self, targets: Mapping[str, int]) -> int:
        return sum(targets[p.name] * p.gpus_per_worker for p in self.config.pools)


def _ceil(workers: float) -> int:
    """Whole workers for a fractional demand; 1e-9 absorbs float error (2.0000000001 is 2)."""
    if math.isinf(workers):
        return 1 << 30
    return max(math.ceil(workers - 1e-9), 0)


def _clamp(workers: int, pool: PlannerPoolConfig) -> int:
    return min(max(workers, pool.min_workers), pool.max_workers)


def same_load(config: PlannerConfig, load: Load) -> dict[str, Load]:
    """`load` for every pool: what `decide` takes when each pool sees all the traffic (one
    prefill and one decode pool, or one aggregated pool). Several pools of one role split the
    traffic by the router's grid, which the caller must apportion."""
    return {pool.name: load for pool in config.pools}
