"""Capacity profiles: JSON in and out, capacity within a target and latency at a load against
hand-computed interpolation, and the online correction tracking a pool slower than profiled."""
from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import pytest

from tandem.errors import InvalidRequest
from tandem.planner.demand import PoolModel
from tandem.planner.profile import (
    Correction,
    WorkerProfile,
    profile_from_dict,
    read_profile,
    write_profile,
)

#: Prefill: at ISL 1000 TTFT crosses 400 ms at 7500 tok/s (between 5000 @ 200 and 10000 @ 600),
#: at ISL 4000 at 2500 tok/s (between 1000 @ 300 and 4000 @ 500). Decode: at context 1000 ITL
#: crosses 40 ms at 40 streams (16 @ 20, 64 @ 60), at 3000 at 12.8 (8 @ 30, 32 @ 80).
DATA: dict[str, Any] = {
    "version": 1, "engine": "mock", "model": "demo", "gpus_per_worker": 1,
    "prefill": [
        {"isl": 1000, "tokens_per_s": 10000, "ttft_ms": 600},  # out of order on purpose
        {"isl": 1000, "tokens_per_s": 1000, "ttft_ms": 100},
        {"isl": 1000, "tokens_per_s": 5000, "ttft_ms": 200},
        {"isl": 4000, "tokens_per_s": 1000, "ttft_ms": 300},
        {"isl": 4000, "tokens_per_s": 4000, "ttft_ms": 500},
        {"isl": 4000, "tokens_per_s": 8000, "ttft_ms": 1500},
    ],
    "decode": [
        {"context_length": 1000, "batch_size": 1, "itl_ms": 10},
        {"context_length": 1000, "batch_size": 16, "itl_ms": 20},
        {"context_length": 1000, "batch_size": 64, "itl_ms": 60},
        {"context_length": 3000, "batch_size": 1, "itl_ms": 12},
        {"context_length": 3000, "batch_size": 8, "itl_ms": 30},
        {"context_length": 3000, "batch_size": 32, "itl_ms": 80},
    ],
}


@pytest.fixture
def profile() -> WorkerProfile:
    return profile_from_dict(DATA)


@pytest.mark.parametrize("isl, target, expected", [
    (1000, 400, 7500.0),
    (1000, 150, 3000.0),     # 1000 + (150 - 100) / (200 - 100) * 4000
    (1000, 50, 0.0),         # even the lightest load misses it
    (1000, 1000, 10000.0),   # never crossed: the heaviest measured load, no extrapolation
    (4000, 400, 2500.0),
    (2500, 400, 5000.0),     # halfway between ISL 1000 and 4000
    (500, 400, 7500.0),      # below the measured ISLs: the nearest edge
    (8000, 400, 2500.0),
])
def test_prefill_capacity(profile: WorkerProfile, isl: float, target: float,
                          expected: float) -> None:
    assert profile.max_prefill_tokens_per_s(isl, target) == pytest.approx(expected)


@pytest.mark.parametrize("context, target, expected", [
    (1000, 40, 40.0), (3000, 40, 12.8), (2000, 40, 26.4), (1000, 5, 0.0), (9000, 100, 32.0),
])
def test_decode_capacity(profile: WorkerProfile, context: float, target: float,
                         expected: float) -> None:
    assert profile.max_decode_streams(context, target) == pytest.approx(expected)


def test_a_dip_after_the_crossing_is_not_trusted() -> None:
    data = {"version": 1, "engine": "mock", "model": "m", "decode": [
        {"context_length": 100, "batch_size": b, "itl_ms": t}
        for b, t in ((1, 10), (2, 50), (3, 30), (4, 35))]}
    # Crosses 40 ms between batch 1 and 2; batches 3 and 4 measure under it again (noise).
    assert profile_from_dict(data).max_decode_streams(100, 40) == pytest.approx(1.75)


def test_latency_at_a_load(profile: WorkerProfile) -> None:
    assert profile.ttft_ms(1000, 7500) == pytest.approx(400)
    assert profile.ttft_ms(1000, 10) == pytest.approx(100)        # under the lightest load
    assert profile.ttft_ms(1000, 20000) is None                   # past the heaviest
    # ISL 2500, 3000 tok/s: 150 ms at ISL 1000, 300 + 2/3 * 200 at ISL 4000; halfway between.
    assert profile.ttft_ms(2500, 3000) == pytest.approx((150 + 433.3333) / 2, rel=1e-4)
    assert profile.itl_ms(1000, 40) == pytest.approx(40)
    assert profile.itl_ms(2000, 100) is None


def test_a_profile_without_the_curve_says_so() -> None:
    only_decode = profile_from_dict({**DATA, "prefill": []})
    with pytest.raises(ValueError, match="no prefill points"):
        only_decode.max_prefill_tokens_per_s(1000, 400)


def test_json_round_trip(profile: WorkerProfile, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "profile.json"
    write_profile(profile, path)
    assert read_profile(path) == profile
    assert json.loads(path.read_text())["version"] == 1


@pytest.mark.parametrize("edit, param", [
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d["prefill"][1].update(ttft_ms=-5), "prefill[1].ttft_ms"),
    (lambda d: d["prefill"][0].update(isl=True), "prefill[0].isl"),
    (lambda d: d["decode"][2].update(batch_size=2.5), "decode[2].batch_size"),
    (lambda d: d["decode"][0].pop("itl_ms"), "decode[0]"),
    (lambda d: d["decode"].append(dict(d["decode"][0])), "decode"),
    (lambda d: d.update(prefill=[], decode=[]), "prefill"),
    (lambda d: d.update(gpus_per_worker=0), "gpus_per_worker"),
])
def test_invalid_profiles_name_the_key(edit: Any, param: str) -> None:
    data = copy.deepcopy(DATA)
    edit(data)
    with pytest.raises(InvalidRequest) as e:
        profile_from_dict(data)
    assert e.value.param == param


def test_unreadable_json(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        read_profile(path)


def test_correction_rule() -> None:
    assert Correction().updated(150, 100, 0.3).factor == pytest.approx(0.7 + 0.3 * 1.5)
    # One interval 10x slower counts as 4x at most.
    assert Correction().updated(1000, 100, 0.5).factor == pytest.approx(0.5 + 0.5 * 4)
    assert Correction(1.2).updated(150, 100, 0.0).factor == 1.2
    assert Correction(1.2).updated(0, 100, 0.3).factor == 1.2
    assert Correction(1.25).target(500) == 400


def test_refinement_tracks_a_pool_slower_than_its_profile(profile: WorkerProfile) -> None:
    """The live pool's ITL is 1.5x the profile's at every batch: after some intervals the model
    says what the live pool carries within 40 ms, not what the profile said."""
    def live_itl(streams: float) -> float:
        predicted = profile.itl_ms(1000, streams)
        assert predicted is not None
        return 1.5 * predicted

    model = PoolModel(profile)
    assert model.decode_capacity(1000, 40) == pytest.approx(40)
    for streams in [16, 30, 8, 24] * 5:
        model = model.refined_decode(1000, streams, live_itl(streams), alpha=0.3)
    assert model.decode.factor == pytest.approx(1.5, rel=1e-3)
    # Live ITL <= 40 <=> profile ITL <= 26.67: 16 + (26.67 - 20) / 40 * 48 = 24 streams.
    assert model.decode_capacity(1000, 40) == pytest.approx(24, rel=1e-2)
    assert live_itl(model.decode_capacity(1000, 40)) == pytest.approx(40, rel=1e-2)
    assert model.prefill.factor == 1.0


def test_refinement_skips_loads_past_the_profile(profile: WorkerProfile) -> None:
    model = PoolModel(profile)
    assert model.refined_decode(1000, 500, 300, alpha=0.3) == model
    assert model.refined_prefill(1000, 50000, 3000, alpha=0.3) == model
    faster = model.refined_prefill(1000, 5000, 100, alpha=1.0)
    assert faster.prefill.factor == pytest.approx(0.5)
    assert faster.prefill_capacity(1000, 200) == pytest.approx(7500)
