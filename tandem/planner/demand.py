"""How many workers a pool needs for a load: the load per second divided by what one worker
carries within the pool's target, read from its profile as corrected by the live pool.

- Prefill: prompt tokens per second (rate x mean ISL) / the tokens per second one worker takes
  within the TTFT target at that ISL. The prompt tokens waiting for their first token are a
  floor on it, by Little's law for the queue (tokens waiting = tokens per second x the wait):
  to keep the wait within the target, the pool must take them at waiting / target. A pool that
  keeps up has fewer waiting than that and the floor is below the rate; one that is swamped
  (prompts much longer than those it was sized for, arriving in a burst) shows it at once,
  where the arrival rate of a closed-loop load falls while its requests wait.
- Decode: concurrent streams / the streams one worker decodes within the ITL target at the mean
  context length (ISL + OSL / 2: a stream holds its prompt and, on average over its life, half
  its output). The streams come from Little's law, L = lambda x W: requests arrive at lambda =
  rate, and each decodes for W = OSL x ITL. With W taken at the ITL target, L is the most
  streams the load can keep in flight while the pool meets its target (a faster pool finishes
  them sooner and holds fewer). The requests in flight at the interval's end are a floor on it
  while the load goes on (some arrived in the interval, or wait for a first token): a burst
  that begins late in an interval reads as its average rate over the whole interval, and a
  closed-loop load on a pool too small for it reads low (its users wait longer, so they send
  less: the rate falls as the pool falls behind, as when its prompts grow longer), but every
  one of their requests is in flight, and those waiting for a first token each need a stream
  soon (in disaggregated pools they wait in the prefill pool: the decode pool must not shrink
  under them). Not once the load stopped: streams left running then need no new workers, and
  the pool may shrink under them (its removed workers drain them).
- Aggregated: one worker does both, so its two shares add (a worker at 60% of its prefill
  capacity has 40% of its time left to decode). Linear, and so conservative where the engine
  overlaps prefill with decode.

The result is fractional; tandem.planner.decision rounds it up and applies bounds, hysteresis
and the GPU budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tandem.errors import InvalidRequest
from tandem.planner.config import PlannerPoolConfig
from tandem.planner.predictor import Load
from tandem.planner.profile import Correction, WorkerProfile


@dataclass(frozen=True)
class PoolModel:
    """A pool's capacity model: its workers' profile and how far the live pool is from it."""

    profile: WorkerProfile
    #: Live TTFT against the profile's.
    prefill: Correction = Correction()
    #: Live ITL against the profile's.
    decode: Correction = Correction()

    def prefill_capacity(self, isl: float, ttft_target_ms: float) -> float:
        """Prompt tokens per second one worker takes at `isl` within the target, corrected."""
        return self.profile.max_prefill_tokens_per_s(isl, self.prefill.target(ttft_target_ms))

    def decode_capacity(self, context_length: float, itl_target_ms: float) -> float:
        """Streams one worker decodes at `context_length` within the target, corrected."""
        return self.profile.max_decode_streams(context_length, self.decode.target(itl_target_ms))

    def refined_prefill(self, isl: float, tokens_per_s_per_worker: float,
                        observed_ttft_ms: float, alpha: float) -> PoolModel:
        """This model with its prefill correction updated by one interval: the p90 TTFT seen
        while each worker took `tokens_per_s_per_worker`. Unchanged where the profile cannot
        predict that load (past its heaviest point) or nothing was observed."""
        predicted = self.profile.ttft_ms(isl, tokens_per_s_per_worker)
        if predicted is None:
            return self
        return replace(self, prefill=self.prefill.updated(observed_ttft_ms, predicted, alpha))

    def refined_decode(self, context_length: float, streams_per_worker: float,
                       observed_itl_ms: float, alpha: float) -> PoolModel:
        """As refined_prefill, for the p90 ITL seen at `streams_per_worker`."""
        predicted = self.profile.itl_ms(context_length, streams_per_worker)
        if predicted is None:
            return self
        return replace(self, decode=self.decode.updated(observed_itl_ms, predicted, alpha))


@dataclass(frozen=True)
class Demand:
    #: Workers the load needs, fractional; inf when the profile misses the target even at its
    #: lightest load and there is load.
    workers: float
    #: How it was computed, for the decision log.
    reason: str


def check_model(pool: PlannerPoolConfig, model: PoolModel) -> None:
    """Raises InvalidRequest when the profile cannot size the pool: measured on another number
    of GPUs per worker, or missing the curve the pool's role needs."""
    profile = model.profile
    if profile.gpus_per_worker != pool.gpus_per_worker:
        raise InvalidRequest(f"planner pool '{pool.name}': its profile was measured on workers "
                             f"of {profile.gpus_per_worker} GPUs, the pool's have "
                             f"{pool.gpus_per_worker}", param=f"{pool.name}.profile")
    for needed, points, phase in ((pool.uses_prefill, profile.prefill, "prefill"),
                                  (pool.uses_decode, profile.decode, "decode")):
        if needed and not points:
            raise InvalidRequest(f"planner pool '{pool.name}' ({pool.role}) needs {phase} "
                                 "points in its profile", param=f"{pool.name}.profile")


def decode_context_length(load: Load) -> float:
    """Mean tokens a stream holds over its life: ISL + OSL / 2."""
    return load.mean_isl + load.mean_osl / 2


def concurrent_streams(load: Load, itl_ms: float) -> float:
    """Little's law: streams in flight = arrival rate x time each decodes (OSL x ITL)."""
    return load.request_rate * load.mean_osl * itl_ms / 1000


def pool_demand(pool: PlannerPoolConfig, model: PoolModel, load: Load) -> Demand:
    """The workers `pool` needs for `load` (see the module docstring)."""
    shares: list[tuple[float, str]] = []
    if pool.uses_prefill:
        shares.append(_prefill_share(pool, model, load))
    if pool.uses_decode:
        shares.append(_decode_share(pool, model, load))
    return Demand(sum(workers for workers, _ in shares), "; ".join(text for _, text in shares))


def _prefill_share(pool: PlannerPoolConfig, model: PoolModel, load: Load) -> tuple[float, str]:
    """The arriving prompts' share, or the waiting ones' where it is more: those read the
    profile at their own mean length (longer prompts than the interval's mean: a pool is
    swamped by prompts longer than it was sized for)."""
    target, corrected = pool.ttft_target_ms, _corrected(model.prefill)
    capacity = model.prefill_capacity(load.mean_isl, target)
    arriving = load.prompt_tokens_per_s
    share = _share(arriving, capacity, f"{_num(arriving)} prompt tok/s at ISL "
                   f"{load.mean_isl:.0f} over {_num(capacity)} tok/s per worker within TTFT "
                   f"{target:g} ms{corrected}")
    if not load.queued_prompt_tokens:
        return share
    waiting = load.queued_prompt_tokens * 1000 / target
    capacity = model.prefill_capacity(load.waiting_isl, target)
    floor = _share(waiting, capacity, f"{_num(waiting)} prompt tok/s to take the "
                   f"{_num(load.queued_prompt_tokens)} waiting for a first token at ISL "
                   f"{load.waiting_isl:.0f} within TTFT {target:g} ms ({_num(arriving)} "
                   f"arriving) over {_num(capacity)} tok/s per worker{corrected}")
    return floor if floor[0] > share[0] else share


def _decode_share(pool: PlannerPoolConfig, model: PoolModel, load: Load) -> tuple[float, str]:
    """Little's law's streams, or those in flight where they need more workers; these at the
    context of the prompts waiting where that is longer (they will be decoded at it)."""
    target, corrected = pool.itl_target_ms, _corrected(model.decode)
    little = concurrent_streams(load, target)
    rate = f"{_num(load.request_rate)} req/s x OSL {load.mean_osl:.0f} x ITL {target:g} ms"
    context = decode_context_length(load)
    capacity = model.decode_capacity(context, target)
    share = _share(little, capacity, f"{_num(little)} streams ({rate}) at context "
                   f"{context:.0f} over {_num(capacity)} streams per worker within ITL "
                   f"{target:g} ms{corrected}")
    if load.inflight <= little and load.waiting_isl <= load.mean_isl:
        return share
    context = max(context, load.waiting_isl + load.mean_osl / 2)
    capacity = model.decode_capacity(context, target)
    floor = _share(load.inflight, capacity, f"{_num(load.inflight)} streams (in flight; "
                   f"{_num(little)} by {rate}) at context {context:.0f} over {_num(capacity)} "
                   f"streams per worker within ITL {target:g} ms{corrected}")
    return floor if floor[0] > share[0] else share


def _share(demand: float, capacity: float, what: str) -> tuple[float, str]:
    if demand <= 0:
        return 0.0, f"{what} = 0 workers"
    if capacity <= 0:
        return math.inf, f"{what}: the target is out of the profile's reach"
    workers = demand / capacity
    return workers, f"{what} = {workers:.3g} workers"


def _num(x: float) -> str:
    """Whole numbers from 100 up, three significant digits below."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _corrected(correction: Correction) -> str:
    return "" if correction.factor == 1 else f" (live x{correction.factor:.2f} the profile)"
