"""The planner's config: YAML in, typed and validated, errors that name the key at fault."""
from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tandem.errors import InvalidRequest
from tandem.planner.config import (
    HysteresisConfig,
    PlannerConfig,
    PlannerPoolConfig,
    planner_config_from_dict,
    read_planner_config,
)

EXAMPLE = """
interval_s: 20
gpu_budget: 8
hysteresis: {scale_down_intervals: 3}
pools:
  - {name: prefill, role: prefill, ttft_target_ms: 500, max_workers: 4, profile: p.json}
  - {name: decode, role: decode, itl_target_ms: 50, min_workers: 2, max_workers: 6,
     gpus_per_worker: 1}
"""


def _pools(*extra: dict[str, Any]) -> dict[str, Any]:
    return {"pools": [{"name": "decode", "role": "decode", "itl_target_ms": 40}, *extra]}


def test_reads_a_yaml_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "planner.yaml"
    path.write_text(EXAMPLE)
    config = read_planner_config(path)
    assert config.interval_s == 20.0 and isinstance(config.interval_s, float)
    assert config.gpu_budget == 8
    assert config.hysteresis == HysteresisConfig(scale_down_intervals=3)
    prefill, decode = config.pools
    assert prefill == PlannerPoolConfig(name="prefill", role="prefill", ttft_target_ms=500,
                                        max_workers=4, profile="p.json")
    assert (decode.min_workers, decode.max_workers, decode.itl_target_ms) == (2, 6, 50)
    assert config.pool("decode") is decode
    assert prefill.uses_prefill and not prefill.uses_decode


def test_defaults_are_documented_values() -> None:
    config = planner_config_from_dict(_pools())
    assert (config.interval_s, config.gpu_budget, config.predictor_window) == (30.0, 0, 3)
    assert config.scale_up_check_s == 3.0
    assert config.hysteresis == HysteresisConfig(2, 0.2, 2)
    assert (config.pools[0].min_workers, config.pools[0].max_workers) == (1, 8)


@pytest.mark.parametrize("data, param", [
    ({"pools": [{"name": "d", "role": "decode", "itl_target_ms": 40, "itl_taget": 1}]},
     "pools[0].itl_taget"),
    ({**_pools(), "interval": 30}, "interval"),
    ({**_pools(), "hysteresis": {"cooldown": 1}}, "hysteresis.cooldown"),
])
def test_unknown_keys_are_named_by_path(data: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        planner_config_from_dict(data)
    assert e.value.param == param


@pytest.mark.parametrize("pool, param, words", [
    ({"name": "p", "role": "prefill"}, "p.ttft_target_ms", "needs ttft_target_ms > 0"),
    ({"name": "a", "role": "agg", "ttft_target_ms": 500}, "a.itl_target_ms", "needs itl"),
    ({"name": "d2", "role": "decode", "itl_target_ms": 9, "ttft_target_ms": 5},
     "d2.ttft_target_ms", "does not apply to a decode pool"),
    ({"name": "x", "role": "aggregated", "itl_target_ms": 9}, "x.role", "one of prefill"),
    ({"name": "z", "role": "decode", "itl_target_ms": 9, "min_workers": 0}, "z.min_workers",
     "min_workers must be >= 1"),
    ({"name": "m", "role": "decode", "itl_target_ms": 9, "min_workers": 3, "max_workers": 2},
     "m.max_workers", "must be >= min_workers"),
    ({"name": "g", "role": "decode", "itl_target_ms": 9, "gpus_per_worker": 0},
     "g.gpus_per_worker", ">= 1"),
    ({"role": "decode", "itl_target_ms": 9}, "pools.name", "needs a name"),
])
def test_pool_values_are_checked(pool: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        planner_config_from_dict({"pools": [pool]})
    assert e.value.param == param
    assert words in e.value.message


@pytest.mark.parametrize("value", ["2", True, 1.5])
def test_types_are_strict(value: object) -> None:
    with pytest.raises(InvalidRequest) as e:
        planner_config_from_dict({"pools": [{"name": "d", "role": "decode",
                                             "itl_target_ms": 9, "max_workers": value}]})
    assert e.value.param == "pools[0].max_workers"


def test_pool_names_are_unique() -> None:
    with pytest.raises(InvalidRequest, match="repeated: decode"):
        planner_config_from_dict(_pools({"name": "decode", "role": "decode",
                                         "itl_target_ms": 10}))


def test_budget_must_hold_the_minimums() -> None:
    data = _pools({"name": "p", "role": "prefill", "ttft_target_ms": 300, "min_workers": 2,
                   "gpus_per_worker": 2})
    with pytest.raises(InvalidRequest, match=r"below the GPUs .* min_workers \(5\)") as e:
        planner_config_from_dict({**data, "gpu_budget": 4})
    assert e.value.param == "gpu_budget"
    assert planner_config_from_dict({**data, "gpu_budget": 5}).gpu_budget == 5


@pytest.mark.parametrize("data, param", [
    ({"interval_s": 0}, "interval_s"),
    ({"gpu_budget": -1}, "gpu_budget"),
    ({"scale_up_check_s": -1}, "scale_up_check_s"),
    ({"scale_up_check_s": float("inf")}, "scale_up_check_s"),
    ({"predictor_window": 0}, "predictor_window"),
    ({"correction_alpha": 1.5}, "correction_alpha"),
    ({"hysteresis": {"scale_down_intervals": 0}}, "hysteresis.scale_down_intervals"),
    ({"hysteresis": {"scale_down_headroom": 1.0}}, "hysteresis.scale_down_headroom"),
    ({"hysteresis": {"cooldown_intervals": -1}}, "hysteresis.cooldown_intervals"),
])
def test_global_values_are_checked(data: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        planner_config_from_dict({**_pools(), **data})
    assert e.value.param == param


def test_a_config_without_pools_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="at least one pool"):
        planner_config_from_dict({"interval_s": 10})
    # The class itself builds with no pools, so that defaults can be taken from it (to_argv).
    assert PlannerConfig().pools == []


def test_bad_files(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [\n")
    with pytest.raises(InvalidRequest, match="not valid YAML"):
        read_planner_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(InvalidRequest, match="must be a mapping"):
        read_planner_config(listed)
    with pytest.raises(OSError):
        read_planner_config(tmp_path / "missing.yaml")
