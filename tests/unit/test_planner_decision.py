"""Decisions: demand from the profile by hand-computed figures, bounds, the GPU budget's order,
hysteresis (no flapping, back to the minimum within 3 intervals), with the predictor in the loop
where the behaviour depends on it."""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from tandem.errors import InvalidRequest
from tandem.planner.config import PlannerConfig, planner_config_from_dict
from tandem.planner.decision import Decider, Decision, same_load
from tandem.planner.demand import PoolModel
from tandem.planner.predictor import Load, LoadPredictor
from tandem.planner.profile import profile_from_dict

#: One worker takes 7500 prompt tok/s within TTFT 400 ms (between 5000 @ 200 and 10000 @ 600)
#: and decodes 40 streams within ITL 40 ms (between 16 @ 20 and 64 @ 60). With ISL 1000 and
#: OSL 100, a rate of r req/s needs r / 7.5 prefill workers, and 4r streams (r x 100 x 40 ms,
#: Little's law) over 40 per worker = r / 10 decode workers.
PROFILE = profile_from_dict({
    "version": 1, "engine": "mock", "model": "demo", "gpus_per_worker": 1,
    "prefill": [{"isl": 1000, "tokens_per_s": s, "ttft_ms": t}
                for s, t in ((1000, 100), (5000, 200), (10000, 600))],
    "decode": [{"context_length": 1000, "batch_size": b, "itl_ms": t}
               for b, t in ((1, 10), (16, 20), (64, 60))],
})
MODEL = PoolModel(PROFILE)


def disagg(**overrides: Any) -> PlannerConfig:
    prefill = {"name": "prefill", "role": "prefill", "ttft_target_ms": 400, "max_workers": 8}
    decode = {"name": "decode", "role": "decode", "itl_target_ms": 40, "max_workers": 8}
    prefill.update(overrides.pop("prefill", {}))
    decode.update(overrides.pop("decode", {}))
    return planner_config_from_dict({"pools": [prefill, decode], **overrides})


def models(config: PlannerConfig) -> dict[str, PoolModel]:
    """MODEL for every pool, as measured on its number of GPUs per worker."""
    return {pool.name: PoolModel(dataclasses.replace(PROFILE,
                                                     gpus_per_worker=pool.gpus_per_worker))
            for pool in config.pools}


def step(decider: Decider, rate: float, isl: float = 1000, osl: float = 100) -> Decision:
    config = decider.config
    return decider.decide(same_load(config, Load(rate, isl, osl)), models(config))


def test_demand_matches_the_hand_computed_figures() -> None:
    decision = step(Decider(disagg()), rate=16)
    prefill, decode = decision.pools
    assert prefill.demand == pytest.approx(16 / 7.5) and prefill.target == 3
    assert decode.demand == pytest.approx(1.6) and decode.target == 2
    assert "16000 prompt tok/s at ISL 1000 over 7500 tok/s per worker" in prefill.reason
    assert "64 streams (16 req/s x OSL 100 x ITL 40 ms)" in decode.reason
    assert prefill.reason.startswith("scale up 1 -> 3")
    assert decision.summary() == "interval 0: prefill 1 -> 3, decode 1 -> 2; 5 GPUs"


def test_requests_in_flight_are_a_floor_on_the_decode_streams() -> None:
    """A burst late in an interval: the rate averaged over the interval reads 4 req/s (16
    streams by Little's law, 0.4 workers), but 120 are in flight: 3 workers. Prefill is sized
    on the rate alone (none of them waits for a first token here)."""
    config = disagg()
    burst = Load(4, 1000, 100, inflight=120)
    prefill, decode = Decider(config).decide(same_load(config, burst), models(config)).pools
    assert decode.demand == pytest.approx(3) and decode.target == 3
    assert "120 streams (in flight; 16 by 4 req/s x OSL 100 x ITL 40 ms)" in decode.reason
    assert prefill.demand == pytest.approx(4000 / 7500)
    # Fewer in flight than Little's law at the target (a pool faster than its target): the
    # rate decides, as without the floor.
    calm = Load(16, 1000, 100, inflight=30)
    assert Decider(config).decide(same_load(config, calm), models(config)).pools[1].demand \
        == pytest.approx(1.6)


def test_prompts_waiting_for_a_first_token_are_a_floor_on_both_pools() -> None:
    """Longer prompts than the prefill pool was sized for: 16 of them wait (16,000 tokens),
    and the closed-loop load's arrival rate fell to 1 req/s meanwhile. Prefill must take the
    waiting tokens within the TTFT target, 16,000 / 0.4 s = 40,000 tok/s over 7,500 per worker:
    5.33 workers; decode must hold the 16 streams they will become (in flight while the load
    goes on: tandem.planner.observe's floor), not the 4 of the rate."""
    config = disagg()
    swamped = Load(1, 1000, 100, inflight=16, queued=16, queued_prompt_tokens=16000)
    prefill, decode = Decider(config).decide(same_load(config, swamped), models(config)).pools
    assert prefill.demand == pytest.approx(40000 / 7500) and prefill.target == 6
    assert ("40000 prompt tok/s to take the 16000 waiting for a first token at ISL 1000 "
            "within TTFT 400 ms (1000 arriving) over 7500 tok/s per worker") in prefill.reason
    assert decode.demand == pytest.approx(16 / 40)
    assert "16 streams (in flight; 4 by 1 req/s x OSL 100" in decode.reason
    # A pool that keeps up has fewer waiting than its rate takes in a TTFT target (2,000
    # tokens against 16 x 1000 x 0.4 s): the rate decides, as without the floors.
    calm = Load(16, 1000, 100, inflight=2, queued=2, queued_prompt_tokens=2000)
    prefill, decode = Decider(config).decide(same_load(config, calm), models(config)).pools
    assert prefill.demand == pytest.approx(16 / 7.5) and decode.demand == pytest.approx(1.6)
    assert "waiting" not in prefill.reason and "in flight" not in decode.reason


def test_an_exact_demand_is_not_rounded_up_by_float_error() -> None:
    assert step(Decider(disagg()), rate=15).targets() == {"prefill": 2, "decode": 2}


def test_an_aggregated_pool_adds_its_prefill_and_decode_shares() -> None:
    config = planner_config_from_dict({"pools": [
        {"name": "agg", "role": "agg", "ttft_target_ms": 400, "itl_target_ms": 40}]})
    decision = step(Decider(config), rate=15)
    assert decision.pools[0].demand == pytest.approx(15 / 7.5 + 15 / 10)
    assert decision.targets() == {"agg": 4}


def test_scales_up_ahead_of_a_rising_load() -> None:
    """A ramp of 1 to 64 req/s: the predictor's trend asks for each interval's workers before
    its load arrives, targets never fall, and the pools end at their ceilings."""
    config = disagg(decode={"max_workers": 16})
    decider, predictor = Decider(config), LoadPredictor(config.predictor_window)
    rates = list(range(1, 65, 3))
    previous = {"prefill": 1, "decode": 1}
    for now, coming in zip(rates, rates[1:]):
        predictor.observe(now, 1000, 100)
        load = predictor.predict()
        assert load is not None
        targets = decider.decide(same_load(config, load), models(config)).targets()
        assert all(targets[p] >= previous[p] for p in targets)
        if now > 1:  # the trend needs two intervals
            assert targets["prefill"] >= min(math.ceil(coming / 7.5), 8)
            assert targets["decode"] >= math.ceil(coming / 10)
        previous = targets
    assert previous == {"prefill": 8, "decode": 7}


def test_bounds() -> None:
    config = disagg(prefill={"min_workers": 2, "max_workers": 3})
    assert step(Decider(config), rate=0).targets() == {"prefill": 2, "decode": 1}
    assert step(Decider(config), rate=1000).targets() == {"prefill": 3, "decode": 8}
    unreachable = disagg(prefill={"ttft_target_ms": 50})  # the profile's lightest load: 100 ms
    prefill = step(Decider(unreachable), rate=1).pools[0]
    assert prefill.target == 8 and math.isinf(prefill.demand)
    assert "out of the profile's reach" in prefill.reason


def test_a_restarted_planner_starts_from_the_counts_it_observes() -> None:
    decider = Decider(disagg(), current={"decode": 5, "prefill": 99})
    first = step(decider, rate=0)
    assert first.targets() == {"prefill": 8, "decode": 5}  # 99 is past max_workers
    assert "hold 5: wants 1 for 1 of 2 intervals" in first.pools[1].reason
    assert step(decider, rate=0).targets() == {"prefill": 1, "decode": 1}


def test_budget_keeps_the_ratio_of_the_demand() -> None:
    """Prefill wants 6 workers, decode 2; 4 GPUs: cut from whichever most exceeds its demand,
    so prefill keeps 3 and decode 1 (3:1, as demanded)."""
    config = disagg(gpu_budget=4)
    loads = {"prefill": Load(45, 1000, 100), "decode": Load(20, 1000, 100)}
    decision = Decider(config).decide(loads, models(config))
    assert decision.targets() == {"prefill": 3, "decode": 1}
    assert decision.num_gpus == 4
    assert all("cut to" in p.reason and "GPU budget" in p.reason for p in decision.pools)
    assert [p.wanted for p in decision.pools] == [6, 2]


@pytest.mark.parametrize("overrides, budget, expected", [
    # Equal cover: the pool with more GPUs per worker gives one up first.
    ({"prefill": {"gpus_per_worker": 2}}, 5, {"prefill": 1, "decode": 2}),
    # Equal cover and GPUs: the pool listed later gives one up first.
    ({}, 3, {"prefill": 2, "decode": 1}),
    # Never below min_workers.
    ({"decode": {"min_workers": 2}}, 3, {"prefill": 1, "decode": 2}),
])
def test_budget_ties_and_floors(overrides: dict[str, Any], budget: int,
                                expected: dict[str, int]) -> None:
    config = disagg(gpu_budget=budget, **overrides)
    loads = {"prefill": Load(15, 1000, 100), "decode": Load(20, 1000, 100)}  # 2 and 2
    assert Decider(config).decide(loads, models(config)).targets() == expected


def test_a_pool_held_by_hysteresis_gives_way_to_demand_within_the_budget() -> None:
    config = disagg(gpu_budget=8)
    decider = Decider(config)
    busy = {"prefill": Load(7.5, 1000, 100), "decode": Load(60, 1000, 100)}
    assert decider.decide(busy, models(config)).targets() == {"prefill": 1, "decode": 6}
    shifted = {"prefill": Load(45, 1000, 100), "decode": Load(10, 1000, 100)}
    # Decode now needs 1 but hysteresis holds 6; prefill needs 6: the budget takes from decode.
    assert decider.decide(shifted, models(config)).targets() == {"prefill": 6, "decode": 2}


def test_shrinks_only_after_consecutive_intervals_wanting_fewer() -> None:
    decider = Decider(disagg(), current={"prefill": 4, "decode": 4})
    low, high = 7.5, 30.0  # prefill wants 1 or 4
    targets = [step(decider, rate).targets()["prefill"]
               for rate in (low, high, low, high, low, low, low)]
    # Alternating demand never gives two low intervals in a row until the end; then it
    # shrinks to the most the window wanted (with 20% headroom: ceil(1.2) = 2).
    assert targets == [4, 4, 4, 4, 4, 2, 2]


def test_no_scale_down_in_the_cooldown_after_a_scale_up() -> None:
    decider = Decider(disagg())
    assert step(decider, 30).targets()["prefill"] == 4
    held = [step(decider, 0) for _ in range(3)]
    assert [d.targets()["prefill"] for d in held] == [4, 4, 1]
    assert "in the cooldown after the scale-up 2 interval(s) ago" in held[1].pools[0].reason


def _run(config: PlannerConfig, rates: list[float]) -> list[dict[str, int]]:
    decider, predictor = Decider(config), LoadPredictor(config.predictor_window)
    out = []
    for rate in rates:
        predictor.observe(rate, 1000, 100)
        load = predictor.predict()
        assert load is not None
        out.append(decider.decide(same_load(config, load), models(config)).targets())
    return out


@pytest.mark.parametrize("seed", range(10))
def test_no_flapping_under_a_steady_noisy_load(seed: int) -> None:
    """30 req/s, +-10% per interval (Poisson at 10 req/s over 30 s varies ~6%): decode sits
    on the boundary between 3 and 4 workers. After the first intervals no pool shrinks."""
    rng = random.Random(seed)
    rates = [30 * (1 + rng.uniform(-0.1, 0.1)) for _ in range(60)]
    targets = _run(disagg(), rates)
    for before, after in zip(targets[4:], targets[5:]):
        assert after["decode"] >= before["decode"] and after["prefill"] >= before["prefill"]
    assert {t["decode"] for t in targets[4:]} <= {3, 4}


@pytest.mark.parametrize("stop_share", [0.0, 0.5])
@pytest.mark.parametrize("burst", [False, True])
def test_back_to_the_minimum_within_three_intervals(stop_share: float, burst: bool) -> None:
    """The load ramps to 40 req/s, holds (or bursts to 60 in its last interval, so the pools
    scale up right before it stops), then stops: at an interval's start (stop_share 0) or
    halfway through it (0.5). By the third decision after it stopped, every pool is at its
    minimum (the issue's bar), with the default hysteresis."""
    config = disagg(prefill={"min_workers": 2})
    peak = [10, 20, 30, 40, 40, 40] + ([60] if burst else [40])
    targets = _run(config, [*peak, 40 * stop_share, 0, 0, 0])
    assert targets[len(peak) - 1]["decode"] >= 4
    assert targets[len(peak) + 2] == {"prefill": 2, "decode": 1}
    assert targets[len(peak) + 3] == {"prefill": 2, "decode": 1}


def test_a_longer_cooldown_misses_that_bar() -> None:
    """The test above can fail: with a cooldown of 3 the burst case takes a fourth interval."""
    config = dataclasses.replace(disagg(), hysteresis=dataclasses.replace(
        disagg().hysteresis, cooldown_intervals=3))
    targets = _run(config, [10, 20, 30, 40, 60, 0, 0, 0, 0])
    assert targets[7]["decode"] > 1 and targets[8]["decode"] == 1


def test_profiles_that_cannot_size_their_pool_are_refused() -> None:
    config = disagg(decode={"gpus_per_worker": 2})
    with pytest.raises(InvalidRequest, match="measured on workers of 1 GPUs"):
        Decider(config).decide(same_load(config, Load(1, 1000, 100)),
                               {"prefill": MODEL, "decode": MODEL})
    only_prefill = PoolModel(dataclasses.replace(PROFILE, decode=()))
    config = disagg()
    with pytest.raises(InvalidRequest, match="needs decode points"):
        Decider(config).decide(same_load(config, Load(1, 1000, 100)),
                               {"prefill": MODEL, "decode": only_prefill})


def fast(decider: Decider, rate: float, inflight: float) -> Decision | None:
    """A backlog check: the last interval's load at `rate` with `inflight` requests in flight."""
    config = decider.config
    return decider.scale_up_now(same_load(config, Load(rate, 1000, 100, inflight=inflight)),
                                models(config))


def test_a_backlog_grows_a_pool_between_intervals() -> None:
    """10 req/s: prefill 2 (10 / 7.5), decode 1 (40 streams / 40). A burst of 120 requests in
    flight needs 3 decode workers now; prefill, sized on the rate, keeps its 2."""
    decider = Decider(disagg())
    assert step(decider, 10).targets() == {"prefill": 2, "decode": 1}
    decision = fast(decider, 10, inflight=120)
    assert decision is not None and decision.fast and decision.targets() == {
        "prefill": 2, "decode": 3}
    prefill, decode = decision.pools
    assert not prefill.is_change and decode.previous == 1
    assert decode.reason.startswith("fast scale up 1 -> 3 on the backlog: 120 "
                                    "streams (in flight;")
    assert decision.summary() == "fast scale-up after interval 0: prefill 2, decode 1 -> 3; 5 GPUs"
    assert fast(decider, 10, inflight=120) is None  # grown already: nothing more to do


@pytest.mark.parametrize("inflight", [0, 25, 40, 41, 48])
def test_no_fast_scale_up_for_a_load_the_pool_holds(inflight: float) -> None:
    """One decode worker holds 40 streams within its target. Up to 40 in flight (a steady load
    at capacity), and up to 20% more (the scale-down headroom: the noise of such a load, which
    an interval would not shrink the pool back from), it is not grown."""
    decider = Decider(disagg())
    step(decider, 10)
    assert fast(decider, 10, inflight) is None
    grown = fast(decider, 10, 49)  # 1.23 workers' worth: past the headroom
    assert grown is not None and grown.targets()["decode"] == 2


def test_a_fast_scale_up_keeps_to_max_workers_and_the_budget() -> None:
    decider = Decider(disagg(decode={"max_workers": 3}))
    step(decider, 10)
    capped = fast(decider, 10, inflight=400)  # 10 workers' worth
    assert capped is not None and capped.targets()["decode"] == 3
    # A budget of 4 GPUs with prefill holding 2 leaves decode one more, and no prefill worker
    # is taken for it.
    decider = Decider(disagg(gpu_budget=4))
    step(decider, 10)
    cut = fast(decider, 10, inflight=400)
    assert cut is not None and cut.targets() == {"prefill": 2, "decode": 2}
    assert cut.num_gpus == 4 and "short of 8 by the GPU budget" in cut.pools[1].reason
    assert fast(decider, 10, inflight=400) is None  # no GPU left: no decision
    full = Decider(disagg(gpu_budget=3))
    step(full, 10)
    assert fast(full, 10, inflight=400) is None


def test_a_fast_scale_up_starts_the_cooldown() -> None:
    """8 req/s: decode 1 (32 streams, 38 with the headroom). The burst ends right after the
    fast scale-up: the next interval decisions hold the pool for the cooldown (2 decisions),
    then shrink it once; a check that finds no more than one worker holds does not grow it
    back (no flapping)."""
    decider = Decider(disagg())
    step(decider, 8)
    assert fast(decider, 8, inflight=200) is not None  # decode 1 -> 5
    held = [step(decider, 8) for _ in range(3)]
    assert [d.targets()["decode"] for d in held] == [5, 5, 1]
    assert "in the cooldown after the scale-up 2 interval(s) ago" in held[1].pools[1].reason
    assert fast(decider, 8, inflight=40) is None
    assert step(decider, 8).targets()["decode"] == 1
