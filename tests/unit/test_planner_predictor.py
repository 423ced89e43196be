"""The load predictor: last interval plus the moving-average trend, clamped at 0."""
from __future__ import annotations

import random

import pytest

from tandem.planner.predictor import Load, LoadPredictor


def test_nothing_to_predict_before_the_first_interval() -> None:
    assert LoadPredictor().predict() is None


def test_one_interval_predicts_itself() -> None:
    p = LoadPredictor()
    p.observe(4.0, 1000, 200)
    assert p.predict() == Load(4.0, 1000, 200)


def test_a_ramp_is_predicted_one_step_ahead() -> None:
    p = LoadPredictor(window=3)
    for rate in (1, 2, 3, 4, 5):
        p.observe(rate, 200, 200)
    load = p.predict()
    assert load is not None and load.request_rate == pytest.approx(6.0)
    assert load.prompt_tokens_per_s == pytest.approx(1200)


def test_trend_is_the_mean_change_over_the_window() -> None:
    p = LoadPredictor(window=3)
    for rate in (10, 1, 2, 4, 8):  # the 10 has left the window of 3 changes
        p.observe(rate)
    assert p.num_observed == 4
    load = p.predict()
    assert load is not None and load.request_rate == pytest.approx(8 + (8 - 1) / 3)


def test_a_stop_predicts_zero_not_negative() -> None:
    p = LoadPredictor()
    for rate in (20, 20, 20, 0):
        p.observe(rate, 4000, 100)
    load = p.predict()
    assert load is not None and load.request_rate == 0.0
    assert load.mean_isl == 4000  # unchanged means: no trend


def test_unmeasured_means_repeat_the_last_known() -> None:
    p = LoadPredictor()
    p.observe(1.0)               # no request finished yet: no means at all
    p.observe(2.0, 300, 50)
    p.observe(3.0, None, None)   # none finished in this interval
    load = p.predict()
    assert load is not None
    assert (load.mean_isl, load.mean_osl) == (pytest.approx(300 + 300 / 2),
                                              pytest.approx(50 + 50 / 2))


def test_an_isl_shift_is_followed() -> None:
    p = LoadPredictor(window=3)
    for isl in (200, 200, 200, 4000):
        p.observe(5, isl, 200)
    first = p.predict()
    for _ in range(3):
        p.observe(5, 4000, 200)
    settled = p.predict()
    assert first is not None and first.mean_isl > 4000  # overshoots up: more prefill, not less
    assert settled is not None and settled.mean_isl == pytest.approx(4000)


def test_steady_noise_stays_near_the_mean() -> None:
    rng = random.Random(7)
    p = LoadPredictor()
    worst = 0.0
    for i in range(200):
        p.observe(10 * (1 + rng.uniform(-0.1, 0.1)), 1000, 100)
        load = p.predict()
        assert load is not None
        if i >= 3:
            worst = max(worst, abs(load.request_rate - 10) / 10)
    # Last value (+-10%) plus a third of the change over the window (+-6.7%).
    assert worst < 0.17


@pytest.mark.parametrize("rate, isl", [(-1.0, 10.0), (1.0, float("nan")), (float("inf"), 1.0)])
def test_bad_observations_are_refused(rate: float, isl: float) -> None:
    with pytest.raises(ValueError):
        LoadPredictor().observe(rate, isl)


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LoadPredictor(window=0)
