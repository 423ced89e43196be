"""Grid pool selection: Dynamo's global-router config format, grid math, overrides, retry order."""
from __future__ import annotations

import copy
import json
import logging
import math
import pathlib
import random
from collections.abc import Callable
from typing import Any

import pytest

from tandem.errors import InvalidRequest
from tandem.routing.grid import axis_index, decode_context_length, retry_order
from tandem.routing.grid_config import load_grid_config, read_grid_config_file

# --- Dynamo's own configs, copied unchanged -------------------------------------------------------

#: ai-dynamo/dynamo examples/global_planner/global-planner-mocker-test.yaml, the ConfigMap's
#: global_router_config.json (``${K8S_NAMESPACE}`` is filled in by envsubst; any string works).
DYNAMO_MOCKER_TEST = """
{
  "num_prefill_pools": 2,
  "num_decode_pools": 2,
  "prefill_pool_dynamo_namespaces": [
    "${K8S_NAMESPACE}-gp-prefill-0",
    "${K8S_NAMESPACE}-gp-prefill-1"
  ],
  "decode_pool_dynamo_namespaces": [
    "${K8S_NAMESPACE}-gp-decode-0",
    "${K8S_NAMESPACE}-gp-decode-1"
  ],
  "prefill_pool_selection_strategy": {
    "ttft_min_ms": 10, "ttft_max_ms": 3000, "ttft_resolution": 2,
    "isl_min": 0,   "isl_max": 32000, "isl_resolution": 2,
    "prefill_pool_mapping": [[0,1],[0,1]]
  },
  "decode_pool_selection_strategy": {
    "itl_min_ms": 10,  "itl_max_ms": 500,   "itl_resolution": 2,
    "context_length_min": 0, "context_length_max": 32000, "context_length_resolution": 2,
    "decode_pool_mapping": [[0,1],[0,1]]
  }
}
"""

#: ai-dynamo/dynamo examples/global_planner/global-planner-vllm-test.yaml (2 prefill, 1 decode).
DYNAMO_VLLM_TEST = """
{
  "num_prefill_pools": 2,
  "num_decode_pools": 1,
  "prefill_pool_dynamo_namespaces": [
    "${K8S_NAMESPACE}-gp-prefill-0",
    "${K8S_NAMESPACE}-gp-prefill-1"
  ],
  "decode_pool_dynamo_namespaces": [
    "${K8S_NAMESPACE}-gp-decode-0"
  ],
  "prefill_pool_selection_strategy": {
    "ttft_min_ms": 10, "ttft_max_ms": 3000, "ttft_resolution": 2,
    "isl_min": 0,   "isl_max": 32000, "isl_resolution": 2,
    "prefill_pool_mapping": [[0,1],[0,1]]
  },
  "decode_pool_selection_strategy": {
    "itl_min_ms": 10,  "itl_max_ms": 500,   "itl_resolution": 2,
    "context_length_min": 0, "context_length_max": 32000, "context_length_resolution": 2,
    "decode_pool_mapping": [[0,0],[0,0]]
  }
}
"""

#: ai-dynamo/dynamo examples/global_planner/local/agg_config.json
DYNAMO_AGG_CONFIG = """
{
  "mode": "agg",
  "enable_priority_retry": false,
  "num_agg_pools": 2,
  "agg_pool_dynamo_namespaces": ["agg_pool_0", "agg_pool_1"],
  "agg_pool_selection_strategy": {
    "ttft_min_ms": 0,
    "ttft_max_ms": 1000,
    "ttft_resolution": 2,
    "itl_min_ms": 0,
    "itl_max_ms": 1000,
    "itl_resolution": 1,
    "agg_pool_mapping": [[0], [1]],
    "priority_overrides": []
  }
}
"""

#: ai-dynamo/dynamo components/src/dynamo/global_router/tests/test_priority_routing.py,
#: ``_base_config()`` with the overrides and retry settings its tests add: deprecated
#: ``ttft_min``/``itl_min`` keys.
DYNAMO_DEPRECATED_KEYS: dict[str, Any] = {
    "enable_priority_retry": True,
    "prefill_pool_priorities": [10, 0],
    "decode_pool_priorities": [5, 1],
    "num_prefill_pools": 2,
    "num_decode_pools": 2,
    "prefill_pool_dynamo_namespaces": ["ns-prefill-0", "ns-prefill-1"],
    "decode_pool_dynamo_namespaces": ["ns-decode-0", "ns-decode-1"],
    "prefill_pool_selection_strategy": {
        "isl_min": 0,
        "isl_max": 32000,
        "isl_resolution": 2,
        "ttft_min": 10,
        "ttft_max": 3000,
        "ttft_resolution": 2,
        "prefill_pool_mapping": [[0, 1], [0, 1]],
        "priority_overrides": [{"min_priority": 10, "max_priority": 100, "target_pool": 1}],
    },
    "decode_pool_selection_strategy": {
        "context_length_min": 0,
        "context_length_max": 32000,
        "context_length_resolution": 2,
        "itl_min": 10,
        "itl_max": 500,
        "itl_resolution": 2,
        "decode_pool_mapping": [[0, 1], [0, 1]],
        "priority_overrides": [{"min_priority": 5, "max_priority": 50, "target_pool": 0}],
    },
}

#: ai-dynamo/dynamo components/src/dynamo/global_router/tests/test_priority_retry.py,
#: ``_agg_config()`` as ``test_agg_handler_routes_by_input_sequence_length`` edits it: the
#: optional ISL axis of agg mode (Dynamo PR #11835), a 3-D ``agg_pool_mapping``.
DYNAMO_AGG_ISL: dict[str, Any] = {
    "mode": "agg",
    "enable_priority_retry": False,
    "num_agg_pools": 2,
    "agg_pool_dynamo_namespaces": ["agg-short", "agg-long"],
    "agg_pool_priorities": [0, 1],
    "agg_pool_selection_strategy": {
        "ttft_min": 10,
        "ttft_max": 3000,
        "ttft_resolution": 1,
        "itl_min": 5,
        "itl_max": 200,
        "itl_resolution": 1,
        "isl_min": 0,
        "isl_max": 24576,
        "isl_resolution": 2,
        "agg_pool_mapping": [[[0]], [[1]]],
    },
}


def test_dynamo_disagg_example_loads_unchanged(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "global_router_config.json"
    path.write_text(DYNAMO_MOCKER_TEST)
    config = read_grid_config_file(path)
    assert config.mode == "disagg" and not config.enable_priority_retry
    assert config.prefill is not None and config.decode is not None and config.agg is None
    assert config.prefill.names == ("${K8S_NAMESPACE}-gp-prefill-0",
                                    "${K8S_NAMESPACE}-gp-prefill-1")
    assert config.prefill.priorities == (0, 1)  # default: pool order
    assert config.prefill.grid.mapping() == [[0, 1], [0, 1]]
    # ISL step 32000/2 = 16000, TTFT step (3000-10)/2 = 1495.
    # ISL 100 -> int(100/16000) = 0; TTFT 50 -> int(40/1495) = 0 -> mapping[0][0] = 0.
    assert config.select_prefill_pool(100, 50, None).pool == 0
    # ISL 20000 -> 1; TTFT 2000 -> int(1990/1495) = 1 -> mapping[1][1] = 1.
    assert config.select_prefill_pool(20000, 2000, None).pool == 1
    # No TTFT target: midpoint 1505 -> int(1495/1495) = 1 -> pool 1 (Dynamo's fallback).
    assert config.select_prefill_pool(100, None, None).pool == 1
    # Decode: ITL step (500-10)/2 = 245; ITL 20 -> 0, ITL 300 -> int(290/245) = 1.
    assert config.select_decode_pool(5000, 20, None).pool == 0
    assert config.select_decode_pool(5000, 300, None).pool == 1


def test_dynamo_vllm_example_and_agg_example_load_unchanged() -> None:
    vllm = load_grid_config(json.loads(DYNAMO_VLLM_TEST))
    assert vllm.decode is not None and vllm.decode.num_pools == 1
    assert vllm.select_decode_pool(31000, 11, None).pool == 0

    agg = load_grid_config(json.loads(DYNAMO_AGG_CONFIG))
    assert agg.mode == "agg" and agg.agg is not None and agg.prefill is None
    assert agg.agg.names == ("agg_pool_0", "agg_pool_1")
    # TTFT step 500: a tight target (100) is row 0 -> pool 0, a relaxed one (900) row 1 -> pool 1,
    # whatever the ITL (one column).
    assert agg.select_agg_pool(100, 5, None).pool == 0
    assert agg.select_agg_pool(900, 999, None).pool == 1


def test_deprecated_aliases_load_like_the_ms_keys(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tandem.routing.grid_config"):
        old = load_grid_config(DYNAMO_DEPRECATED_KEYS)
    assert "prefill_pool_selection_strategy.ttft_min is deprecated" in caplog.text
    assert "decode_pool_selection_strategy.itl_max is deprecated" in caplog.text
    renamed = copy.deepcopy(DYNAMO_DEPRECATED_KEYS)
    for section, axis in (("prefill_pool_selection_strategy", "ttft"),
                          ("decode_pool_selection_strategy", "itl")):
        for end in ("min", "max"):
            renamed[section][f"{axis}_{end}_ms"] = renamed[section].pop(f"{axis}_{end}")
    assert load_grid_config(renamed) == old
    assert old.enable_priority_retry and old.prefill is not None and old.decode is not None
    assert old.prefill.priorities == (10, 0) and old.decode.priorities == (5, 1)
    # Dynamo's test: grid picks pool 0 for ISL 100 / TTFT 50, priority 50 overrides to pool 1.
    assert old.select_prefill_pool(100, 50, None).pool == 0
    assert old.select_prefill_pool(100, 50, 50).pool == 1
    assert old.select_prefill_pool(100, 50, 5).pool == 0


def test_alias_equal_to_the_key_is_accepted() -> None:
    data = copy.deepcopy(DYNAMO_DEPRECATED_KEYS)
    data["prefill_pool_selection_strategy"]["ttft_min_ms"] = 10
    assert load_grid_config(data).prefill is not None


def test_dynamo_agg_isl_axis() -> None:
    config = load_grid_config(DYNAMO_AGG_ISL)
    assert config.agg is not None
    assert [a.name for a in config.agg.grid.axes] == ["isl", "ttft", "itl"]
    # ISL step 24576/2 = 12288: 4096 tokens -> row 0 (agg-short), 16384 -> row 1 (agg-long),
    # as in Dynamo's test.
    assert config.select_agg_pool(None, None, None, isl=4096).pool == 0
    assert config.select_agg_pool(None, None, None, isl=16384).pool == 1
    with pytest.raises(ValueError, match="needs isl"):
        config.select_agg_pool(100, 10, None)


# --- Grid math -------------------------------------------------------------------------------------

def _dynamo_index(x: float, lo: float, hi: float, resolution: int) -> int:
    """Dynamo's expression, verbatim in effect: max(0, min(int((x - lo) / step), res - 1))."""
    return max(0, min(int((x - lo) / ((hi - lo) / resolution)), resolution - 1))


def test_axis_index_equals_dynamo_formula_on_random_values() -> None:
    rng = random.Random(7)
    for _ in range(20000):
        lo = rng.uniform(-100, 1000)
        hi = lo + rng.choice([rng.uniform(1e-3, 1), rng.uniform(1, 5000)])
        resolution = rng.randint(1, 17)
        x = rng.choice([rng.uniform(lo - (hi - lo), hi + (hi - lo)),
                        lo + (hi - lo) * rng.randint(0, resolution) / resolution,  # boundaries
                        float(rng.randint(-10, 10000))])
        assert axis_index(x, lo, hi, resolution) == _dynamo_index(x, lo, hi, resolution)


def test_axis_index_clamps_infinities_and_rejects_nan() -> None:
    assert axis_index(math.inf, 0, 10, 4) == 3
    assert axis_index(-math.inf, 0, 10, 4) == 0
    assert axis_index(1e308, 0, 1e-300, 4) == 3  # the quotient overflows to inf: no int(inf)
    with pytest.raises(ValueError):
        axis_index(math.nan, 0, 10, 4)


def _numbered(rows: int, cols: int) -> list[list[int]]:
    """mapping[r][c] = r * cols + c, so the pool names the cell and a transposition shows."""
    return [[r * cols + c for c in range(cols)] for r in range(rows)]


def _prefill_decode(**top: Any) -> dict[str, Any]:
    """Non-square grids: prefill 4 ISL rows x 3 TTFT columns, decode 2 context rows x 3 ITL."""
    data: dict[str, Any] = {
        "num_prefill_pools": 12,
        "num_decode_pools": 6,
        "prefill_pool_selection_strategy": {
            "isl_min": 0, "isl_max": 1000, "isl_resolution": 4,             # step 250
            "ttft_min_ms": 100, "ttft_max_ms": 400, "ttft_resolution": 3,   # step 100
            "prefill_pool_mapping": _numbered(4, 3),
        },
        "decode_pool_selection_strategy": {
            "context_length_min": 0, "context_length_max": 8000,
            "context_length_resolution": 2,                                 # step 4000
            "itl_min_ms": 5, "itl_max_ms": 50, "itl_resolution": 3,         # step 15
            "decode_pool_mapping": _numbered(2, 3),
        },
    }
    data.update(top)
    return data


@pytest.mark.parametrize(("isl", "ttft", "cell"), [
    (0, 100, (0, 0)),               # both minimums
    (249, 199.9, (0, 0)),           # 249/250 -> 0, 99.9/100 -> 0
    (250, 200, (1, 1)),             # exact boundaries open the next bucket
    (500, 300, (2, 2)),
    (999, 399, (3, 2)),             # 3.996 -> 3, 2.99 -> 2
    (1000, 400, (3, 2)),            # the maximum itself: int(4) -> 4, clamped to 3; 3 -> 2
    (10**9, 1e9, (3, 2)),           # far beyond: clamped to the last bucket
    (400, math.inf, (1, 2)),
    (-5, 99.0, (0, 0)),             # -0.02 -> int() truncates to 0; -0.01 -> 0
    (-300, 0, (0, 0)),              # -1.2 -> -1, clamped to 0; (0-100)/100 = -1 -> 0
    (600, -math.inf, (2, 0)),
])
def test_prefill_grid_row_is_isl_column_is_ttft(isl: int, ttft: float,
                                                cell: tuple[int, int]) -> None:
    choice = load_grid_config(_prefill_decode()).select_prefill_pool(isl, ttft, None)
    assert choice.cell == cell
    assert choice.pool == cell[0] * 3 + cell[1]


@pytest.mark.parametrize(("context", "itl", "cell"), [
    (0, 5, (0, 0)),
    (3999, 19.99, (0, 0)),          # 3999/4000 -> 0, 14.99/15 -> 0
    (4000, 20, (1, 1)),             # exact boundaries
    (8000, 50, (1, 2)),             # maximums clamp to the last bucket
    (100000, 1000, (1, 2)),
    (-1, 0, (0, 0)),
    (100, 49.99, (0, 2)),
])
def test_decode_grid_row_is_context_column_is_itl(context: int, itl: float,
                                                  cell: tuple[int, int]) -> None:
    choice = load_grid_config(_prefill_decode()).select_decode_pool(context, itl, None)
    assert choice.cell == cell
    assert choice.pool == cell[0] * 3 + cell[1]


def _agg(**strategy: Any) -> dict[str, Any]:
    """Agg: 2 TTFT rows (step 500) x 4 ITL columns (step 25), mapping[r][c] = 4r + c."""
    section = {"ttft_min_ms": 0, "ttft_max_ms": 1000, "ttft_resolution": 2,
               "itl_min_ms": 0, "itl_max_ms": 100, "itl_resolution": 4,
               "agg_pool_mapping": _numbered(2, 4)}
    section.update(strategy)
    return {"mode": "agg", "num_agg_pools": 8, "agg_pool_selection_strategy": section}


@pytest.mark.parametrize(("ttft", "itl", "cell"), [
    (499, 24, (0, 0)),
    (500, 25, (1, 1)),
    (0, 99.9, (0, 3)),
    (1e6, 100, (1, 3)),
    (-1, -1, (0, 0)),
    (None, None, (1, 2)),           # midpoints 500 -> 1 and 50 -> 2
])
def test_agg_grid_row_is_ttft_column_is_itl(ttft: float | None, itl: float | None,
                                            cell: tuple[int, int]) -> None:
    choice = load_grid_config(_agg()).select_agg_pool(ttft, itl, None)
    assert choice.cell == cell and choice.pool == cell[0] * 4 + cell[1]


def test_agg_three_axes_order_isl_ttft_itl() -> None:
    # 2 x 2 x 2 over ISL 0..100, TTFT 0..10, ITL 0..10; mapping[i][t][l] = 4i + 2t + l.
    config = load_grid_config({
        "mode": "agg", "num_agg_pools": 8,
        "agg_pool_selection_strategy": {
            "isl_min": 0, "isl_max": 100, "isl_resolution": 2,
            "ttft_min_ms": 0, "ttft_max_ms": 10, "ttft_resolution": 2,
            "itl_min_ms": 0, "itl_max_ms": 10, "itl_resolution": 2,
            "agg_pool_mapping": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
        }})
    # ISL 60 -> 1, TTFT 2 -> 0, ITL 7 -> 1: pool 4 + 0 + 1 = 5.
    choice = config.select_agg_pool(2, 7, None, isl=60)
    assert choice.cell == (1, 0, 1) and choice.pool == 5
    assert config.agg is not None and config.agg.grid.mapping() == [[[0, 1], [2, 3]],
                                                                     [[4, 5], [6, 7]]]


# --- Fallbacks for missing targets -----------------------------------------------------------------

def test_missing_targets_use_tandem_defaults_then_midpoint() -> None:
    plain = load_grid_config(_prefill_decode())
    # TTFT midpoint 250 -> int(150/100) = 1; ISL 500 -> 2: cell (2, 1) = pool 7.
    choice = plain.select_prefill_pool(500, None, None)
    assert choice.values == (500, 250.0) and choice.pool == 7
    # ITL midpoint 27.5 -> int(22.5/15) = 1; context 100 -> 0: pool 1.
    assert plain.select_decode_pool(100, None, None).pool == 1

    tuned = load_grid_config(_prefill_decode(
        tandem={"default_ttft_target_ms": 120, "default_itl_target_ms": 49}))
    # Default TTFT 120 -> int(20/100) = 0: cell (2, 0) = pool 6. ITL 49 -> 2: pool 2.
    assert tuned.select_prefill_pool(500, None, None).pool == 6
    assert tuned.select_decode_pool(100, None, None).pool == 2
    # A request's own target wins over the default; an explicit 0 is a target, not "missing".
    assert tuned.select_prefill_pool(500, 399, None).pool == 8
    assert tuned.select_prefill_pool(500, 0, None).pool == 6
    assert tuned.select_decode_pool(100, 0, None).pool == 0


def test_nan_target_is_an_invalid_request() -> None:
    config = load_grid_config(_prefill_decode())
    with pytest.raises(InvalidRequest, match="ttft_ms") as info:
        config.select_prefill_pool(10, math.nan, None)
    assert info.value.param == "ttft_ms"


def test_selector_of_the_other_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="disagg mode"):
        load_grid_config(_prefill_decode()).select_agg_pool(1, 1, None)
    with pytest.raises(ValueError, match="agg mode"):
        load_grid_config(_agg()).select_prefill_pool(1, 1, None)


# --- Priority overrides and retry order ------------------------------------------------------------

def test_priority_overrides_win_first_match_inclusive() -> None:
    data = _prefill_decode()
    data["prefill_pool_selection_strategy"]["priority_overrides"] = [
        {"min_priority": 5, "max_priority": 10, "target_pool": 11},
        {"min_priority": 8, "max_priority": 20, "target_pool": 10},  # overlaps: first match wins
    ]
    config = load_grid_config(data)
    grid_pool = config.select_prefill_pool(0, 100, None).pool
    assert grid_pool == 0
    picks = {p: config.select_prefill_pool(0, 100, p) for p in (4, 5, 9, 10, 11, 20, 21)}
    assert {p: c.pool for p, c in picks.items()} == {
        4: 0, 5: 11, 9: 11, 10: 11, 11: 10, 20: 10, 21: 0}
    assert picks[9].override_rule == 0 and picks[11].override_rule == 1
    assert picks[4].override_rule is None
    assert picks[9].cell == (0, 0)  # the grid cell is still reported
    # Overrides belong to their strategy: decode has none.
    assert config.select_decode_pool(0, 5, 9).pool == 0


@pytest.mark.parametrize(("selected", "priorities", "order"), [
    # Dynamo's cases (tests/test_priority_routing.py::TestPriorityRetryOrder).
    (2, [0, 1, 2], (2, 1, 0)),
    (0, [0, 1, 2], (0,)),
    (0, [10, 0, 5], (0, 2, 1)),
    (3, [0, 1, 1, 2], (3, 1, 2, 0)),
    # Pools as slow as the selected one are skipped; ties among faster ones keep index order.
    (2, [1, 0, 1, 0], (2, 1, 3)),
])
def test_retry_order(selected: int, priorities: list[int], order: tuple[int, ...]) -> None:
    assert retry_order(selected, priorities, True) == order
    assert retry_order(selected, priorities, False) == (selected,)


def test_pool_choice_carries_retry_pools_from_config_priorities() -> None:
    data = _prefill_decode(enable_priority_retry=True,
                           decode_pool_priorities=[5, 0, 10, 5, 1, 2])
    data["decode_pool_selection_strategy"]["priority_overrides"] = [
        {"min_priority": 1, "max_priority": 1, "target_pool": 3}]
    config = load_grid_config(data)
    # Context 0 / ITL 49 -> cell (0, 2) = pool 2 (priority 10): then 5s (pools 0, 3), 2, 1, 0.
    choice = config.select_decode_pool(0, 49, None)
    assert choice.pool == 2 and choice.retry_pools == (0, 3, 5, 4, 1)
    assert choice.pools == (2, 0, 3, 5, 4, 1)
    # Retry starts from the overridden pool: pool 3 (priority 5) -> 5, 4, 1.
    assert config.select_decode_pool(0, 49, 1).pools == (3, 5, 4, 1)
    # Prefill priorities default to pool order: pool 7 retries 6, 5, ..., 0.
    assert config.select_prefill_pool(500, 250, None).retry_pools == (6, 5, 4, 3, 2, 1, 0)
    # Retry off: nothing to retry.
    assert load_grid_config(_prefill_decode()).select_decode_pool(0, 49, None).retry_pools == ()


# --- Decode context length -------------------------------------------------------------------------

def test_decode_context_length_adds_half_the_capped_output() -> None:
    assert decode_context_length(1000, 200, 512) == 1100          # 1000 + 200 // 2
    assert decode_context_length(1000, 4096, 512) == 1256         # cap: 1000 + 512 // 2
    assert decode_context_length(1000, 301, None) == 1150         # uncapped, floor of 150.5
    assert decode_context_length(0, 0, 0) == 0
    config = load_grid_config(_prefill_decode(tandem={"typical_osl_cap": 300}))
    assert config.decode_context_length(3900, 8000) == 4050
    # ...which moves a short prompt with a long answer into the second context bucket.
    assert config.select_decode_pool(config.decode_context_length(3900, 8000), 5, None).cell[0] == 1
    with pytest.raises(ValueError):
        decode_context_length(-1, 10, None)


# --- Validation: every error names its key ---------------------------------------------------------

P = "prefill_pool_selection_strategy"
D = "decode_pool_selection_strategy"
A = "agg_pool_selection_strategy"

Mutation = Callable[[dict[str, Any]], object]


def _set(path: str, value: object) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    return apply


def _drop(path: str) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        del node[last]
    return apply


def _overrides(section: str, *rules: dict[str, Any]) -> Mutation:
    return _set(f"{section}.priority_overrides", list(rules))


def _rule(lo: object, hi: object, target: object) -> dict[str, Any]:
    return {"min_priority": lo, "max_priority": hi, "target_pool": target}


# (id, base, mutation, key path named in the message and in .param, a fragment of the message)
INVALID: list[tuple[str, Callable[[], dict[str, Any]], Mutation, str, str]] = [
    ("missing-num-pools", _prefill_decode, _drop("num_prefill_pools"),
     "num_prefill_pools", "is required in disagg mode"),
    ("zero-pools", _prefill_decode, _set("num_decode_pools", 0),
     "num_decode_pools", "must be >= 1"),
    ("bool-pool-count", _prefill_decode, _set("num_prefill_pools", True),
     "num_prefill_pools", "must be an integer, got true"),
    ("missing-strategy", _prefill_decode, _drop(D), D, "is required in disagg mode"),
    ("strategy-not-object", _prefill_decode, _set(P, [1]), P, "must be a JSON object"),
    ("missing-isl-min", _prefill_decode, _drop(f"{P}.isl_min"), f"{P}.isl_min", "is required"),
    ("missing-ttft-min", _prefill_decode, _drop(f"{P}.ttft_min_ms"), f"{P}.ttft_min_ms",
     "is required (or its deprecated alias ttft_min)"),
    ("missing-mapping", _prefill_decode, _drop(f"{D}.decode_pool_mapping"),
     f"{D}.decode_pool_mapping", "is required"),
    ("string-number", _prefill_decode, _set(f"{P}.isl_max", "32000"), f"{P}.isl_max",
     'must be a number, got "32000"'),
    ("bool-number", _prefill_decode, _set(f"{P}.ttft_max_ms", True), f"{P}.ttft_max_ms",
     "must be a number, got true"),
    ("nan-number", _prefill_decode, _set(f"{D}.itl_min_ms", math.nan), f"{D}.itl_min_ms",
     "must be a finite number"),
    ("resolution-zero", _prefill_decode, _set(f"{P}.isl_resolution", 0),
     f"{P}.isl_resolution", "must be >= 1"),
    ("resolution-negative", _prefill_decode, _set(f"{D}.itl_resolution", -2),
     f"{D}.itl_resolution", "must be >= 1"),
    ("resolution-float", _prefill_decode, _set(f"{P}.ttft_resolution", 3.0),
     f"{P}.ttft_resolution", "must be an integer"),
    ("isl-min-equals-max", _prefill_decode, _set(f"{P}.isl_min", 1000), f"{P}.isl_min",
     f"must be less than {P}.isl_max"),
    ("ttft-min-above-max", _prefill_decode, _set(f"{P}.ttft_min_ms", 500), f"{P}.ttft_min_ms",
     f"must be less than {P}.ttft_max_ms"),
    ("context-min-above-max", _prefill_decode, _set(f"{D}.context_length_min", 9000),
     f"{D}.context_length_min", "must be less than"),
    ("itl-min-equals-max", _prefill_decode, _set(f"{D}.itl_max_ms", 5), f"{D}.itl_min_ms",
     f"must be less than {D}.itl_max_ms"),
    ("mapping-rows", _prefill_decode, _set(f"{P}.prefill_pool_mapping", _numbered(3, 3)),
     f"{P}.prefill_pool_mapping", f"has 3 rows but {P}.isl_resolution is 4"),
    ("mapping-transposed", _prefill_decode, _set(f"{D}.decode_pool_mapping", [[0, 1]] * 3),
     f"{D}.decode_pool_mapping", f"has 3 rows but {D}.context_length_resolution is 2"),
    ("mapping-row-length", _prefill_decode,
     _set(f"{P}.prefill_pool_mapping", [[0, 1, 2], [0, 1], [0, 1, 2], [0, 1, 2]]),
     f"{P}.prefill_pool_mapping[1]", f"has 2 entries but {P}.ttft_resolution is 3"),
    ("mapping-not-list", _prefill_decode, _set(f"{D}.decode_pool_mapping", {"0": 1}),
     f"{D}.decode_pool_mapping", "must be a list"),
    ("mapping-row-not-list", _prefill_decode, _set(f"{D}.decode_pool_mapping", [0, 1]),
     f"{D}.decode_pool_mapping[0]", "must be a list"),
    ("mapping-index-too-big", _prefill_decode,
     _set(f"{D}.decode_pool_mapping", [[0, 1, 2], [3, 4, 6]]),
     f"{D}.decode_pool_mapping[1][2]", "= 6 is not a pool index (num_decode_pools is 6)"),
    ("mapping-index-negative", _prefill_decode,
     _set(f"{D}.decode_pool_mapping", [[0, -1, 2], [3, 4, 5]]),
     f"{D}.decode_pool_mapping[0][1]", "= -1 is not a pool index"),
    ("mapping-index-bool", _prefill_decode,
     _set(f"{D}.decode_pool_mapping", [[0, 1, 2], [3, False, 5]]),
     f"{D}.decode_pool_mapping[1][1]", "must be an integer, got false"),
    ("unknown-top-key", _prefill_decode, _set("num_prefil_pools", 2),
     "num_prefil_pools", "unknown key: num_prefil_pools (did you mean num_prefill_pools?)"),
    ("unknown-strategy-key", _prefill_decode, _set(f"{P}.isl_reslution", 4),
     f"{P}.isl_reslution", "(did you mean isl_resolution?)"),
    ("unknown-keys-listed", _prefill_decode, _set(f"{D}.zzz", 1), f"{D}.zzz", "unknown key"),
    ("unknown-override-key", _prefill_decode,
     _overrides(P, {"min_priority": 1, "max_priority": 2, "target_pool": 0, "pool": 1}),
     f"{P}.priority_overrides[0].pool", "unknown key"),
    ("unknown-tandem-key", _prefill_decode, _set("tandem", {"default_ttft_ms": 5}),
     "tandem.default_ttft_ms", "did you mean default_ttft_target_ms?"),
    ("bad-mode", _prefill_decode, _set("mode", "mixed"), "mode", "must be 'disagg' or 'agg'"),
    ("retry-not-bool", _prefill_decode, _set("enable_priority_retry", "yes"),
     "enable_priority_retry", "must be true or false"),
    ("priorities-length", _prefill_decode, _set("prefill_pool_priorities", [0]),
     "prefill_pool_priorities", "has 1 entries but num_prefill_pools is 12"),
    ("priorities-item", _prefill_decode,
     _set("decode_pool_priorities", [0, True, 2, 3, 4, 5]),
     "decode_pool_priorities[1]", "must be an integer"),
    ("namespaces-length", _prefill_decode, _set("decode_pool_dynamo_namespaces", ["a"]),
     "decode_pool_dynamo_namespaces", "has 1 entries but num_decode_pools is 6"),
    ("namespaces-item", _prefill_decode,
     _set("decode_pool_dynamo_namespaces", ["a", "b", 3, "d", "e", "f"]),
     "decode_pool_dynamo_namespaces[2]", "must be a non-empty string"),
    ("overrides-not-list", _prefill_decode, _set(f"{P}.priority_overrides", {"a": 1}),
     f"{P}.priority_overrides", "must be a list"),
    ("override-not-object", _prefill_decode, _overrides(P, [1, 2, 3]),  # type: ignore[arg-type]
     f"{P}.priority_overrides[0]", "must be a JSON object"),
    ("override-min-above-max", _prefill_decode, _overrides(D, _rule(20, 5, 1)),
     f"{D}.priority_overrides[0].min_priority", f"(20) must be <= {D}.priority_overrides[0]"),
    ("override-target-range", _prefill_decode, _overrides(D, _rule(1, 5, 6)),
     f"{D}.priority_overrides[0].target_pool", "= 6 is not a pool index"),
    ("override-float-priority", _prefill_decode, _overrides(P, _rule(1.5, 5, 0)),
     f"{P}.priority_overrides[0].min_priority", "must be an integer"),
    ("override-missing-target", _prefill_decode,
     _overrides(P, {"min_priority": 1, "max_priority": 2}),
     f"{P}.priority_overrides[0].target_pool", "is required"),
    ("override-shadowed", _prefill_decode,
     _overrides(P, _rule(0, 10, 1), _rule(11, 20, 2), _rule(3, 15, 3)),
     f"{P}.priority_overrides[2]", "(priorities 3..15) can never match"),
    ("override-duplicate", _prefill_decode, _overrides(D, _rule(4, 4, 1), _rule(4, 4, 2)),
     f"{D}.priority_overrides[1]", "can never match"),
    ("alias-conflict", lambda: copy.deepcopy(DYNAMO_DEPRECATED_KEYS),
     _set(f"{P}.ttft_min_ms", 20), f"{P}.ttft_min_ms",
     "and its deprecated alias ttft_min are set to different values (20 vs 10)"),
    ("alias-min-above-max", lambda: copy.deepcopy(DYNAMO_DEPRECATED_KEYS),
     _set(f"{D}.itl_min", 600), f"{D}.itl_min", f"must be less than {D}.itl_max"),
    ("agg-missing-pools", _agg, _drop("num_agg_pools"), "num_agg_pools",
     "is required in agg mode"),
    ("agg-missing-strategy", _agg, _drop(A), A, "is required in agg mode"),
    ("agg-mapping-rows", _agg, _set(f"{A}.agg_pool_mapping", _numbered(4, 2)),
     f"{A}.agg_pool_mapping", f"has 4 rows but {A}.ttft_resolution is 2"),
    ("agg-isl-partial", _agg, _set(f"{A}.isl_min", 0), f"{A}.isl_max",
     "is required when isl_min is set"),
    ("agg-isl-2d-mapping", _agg,
     lambda d: d[A].update(isl_min=0, isl_max=10, isl_resolution=2),
     f"{A}.agg_pool_mapping[0]", f"has 4 entries but {A}.ttft_resolution is 2"),
    ("agg-isl-resolution", _agg,
     lambda d: d[A].update(isl_min=0, isl_max=10, isl_resolution=0),
     f"{A}.isl_resolution", "must be >= 1"),
    ("agg-unknown-disagg-key-in-strategy", _agg, _set(f"{A}.context_length_min", 0),
     f"{A}.context_length_min", "unknown key"),
    ("tandem-not-object", _prefill_decode, _set("tandem", None), "tandem",
     "must be a JSON object, got null"),
    ("tandem-negative-default", _prefill_decode,
     _set("tandem", {"default_itl_target_ms": -1}), "tandem.default_itl_target_ms",
     "must be >= 0"),
    ("tandem-cap-float", _prefill_decode, _set("tandem", {"typical_osl_cap": 1.5}),
     "tandem.typical_osl_cap", "must be an integer"),
]


@pytest.mark.parametrize(("base", "mutate", "path", "fragment"),
                         [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_config_names_the_key(base: Callable[[], dict[str, Any]], mutate: Mutation,
                                      path: str, fragment: str) -> None:
    data = base()
    load_grid_config(copy.deepcopy(data))  # the base is valid: the mutation is what fails
    mutate(data)
    with pytest.raises(InvalidRequest) as info:
        load_grid_config(data)
    message = str(info.value)
    assert path in message and fragment in message, message
    assert info.value.param == path


def test_partly_overlapping_overrides_are_kept_as_dynamo_does() -> None:
    # Dynamo's test_first_match_wins: [1, 10] -> 1 and [5, 20] -> 2; priority 7 goes to pool 1.
    data = _prefill_decode()
    data[P]["priority_overrides"] = [_rule(1, 10, 1), _rule(5, 20, 2)]
    config = load_grid_config(data)
    assert config.select_prefill_pool(0, 100, 7).pool == 1
    # A gap in the earlier rules leaves a later rule reachable.
    data[P]["priority_overrides"] = [_rule(0, 10, 1), _rule(12, 20, 2), _rule(3, 15, 3)]
    assert load_grid_config(data).select_prefill_pool(0, 100, 11).pool == 3


def test_keys_of_the_other_mode_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    data = _agg()
    data.update(num_prefill_pools="not even checked", decode_pool_selection_strategy={})
    with caplog.at_level(logging.INFO, logger="tandem.routing.grid_config"):
        config = load_grid_config(data)
    assert config.mode == "agg" and config.prefill is None
    assert "ignores decode_pool_selection_strategy, num_prefill_pools" in caplog.text


def test_top_level_and_file_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidRequest, match="grid config must be a JSON object"):
        load_grid_config([])  # type: ignore[arg-type]
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_prefill_pools": 2,}')
    with pytest.raises(InvalidRequest, match=r"bad\.json is not valid JSON.*line 1"):
        read_grid_config_file(bad)
    with pytest.raises(FileNotFoundError):
        read_grid_config_file(tmp_path / "missing.json")
