"""Reads NVIDIA Dynamo's global-router JSON config into tandem.routing.grid.GridConfig.

The format is Dynamo's, unchanged (``components/src/dynamo/global_router/pool_selection.py``,
``docs/fern/components/router/global-router-config-reference.mdx``)::

    mode                      "disagg" (default) or "agg"
    enable_priority_retry     bool, default false
    disagg: num_prefill_pools, num_decode_pools                    int >= 1
            prefill_pool_dynamo_namespaces, decode_pool_dynamo_namespaces   [str], optional here
            prefill_pool_priorities, decode_pool_priorities          [int], default pool order
            prefill_pool_selection_strategy: isl_min, isl_max, isl_resolution,
                ttft_min_ms, ttft_max_ms, ttft_resolution, prefill_pool_mapping, priority_overrides
            decode_pool_selection_strategy: context_length_min, context_length_max,
                context_length_resolution, itl_min_ms, itl_max_ms, itl_resolution,
                decode_pool_mapping, priority_overrides
    agg:    num_agg_pools, agg_pool_dynamo_namespaces, agg_pool_priorities
            agg_pool_selection_strategy: ttft_min_ms, ttft_max_ms, ttft_resolution,
                itl_min_ms, itl_max_ms, itl_resolution, [isl_min, isl_max, isl_resolution],
                agg_pool_mapping, priority_overrides
    priority_overrides        [{min_priority, max_priority, target_pool}], default []
    tandem                    Tandem only: default_ttft_target_ms, default_itl_target_ms,
                              typical_osl_cap

``ttft_min``/``ttft_max``/``itl_min``/``itl_max`` are accepted as deprecated aliases of the ``_ms``
keys, with a warning. Keys of the other mode are ignored, as in Dynamo.

Stricter than Dynamo, each time with a message naming the key by its path: unknown keys are
rejected (Dynamo ignores them, so typos pass silently there); numbers must be numbers (``true`` is
not one); a key and its alias set to different values, and an override rule that earlier rules
entirely shadow, are rejected. Partly overlapping rules are kept: first match wins, as in Dynamo.
Pool namespaces are optional here, since Tandem's own pool list can name the pools.
"""
from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.errors import InvalidRequest
from tandem.jsonfile import read_json_file
from tandem.routing.grid import (
    Axis,
    GridConfig,
    Mode,
    PoolGrid,
    PoolKind,
    PoolSet,
    PriorityOverride,
    TandemGridOptions,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _AxisKeys:
    name: str
    min_key: str
    max_key: str
    res_key: str
    min_alias: str | None = None
    max_alias: str | None = None

    @property
    def keys(self) -> set[str]:
        return {self.min_key, self.max_key, self.res_key} | {
            k for k in (self.min_alias, self.max_alias) if k is not None}


_ISL = _AxisKeys("isl", "isl_min", "isl_max", "isl_resolution")
_CONTEXT = _AxisKeys("context_length", "context_length_min", "context_length_max",
                     "context_length_resolution")
_TTFT = _AxisKeys("ttft", "ttft_min_ms", "ttft_max_ms", "ttft_resolution", "ttft_min", "ttft_max")
_ITL = _AxisKeys("itl", "itl_min_ms", "itl_max_ms", "itl_resolution", "itl_min", "itl_max")


@dataclass(frozen=True, slots=True)
class _StrategyKeys:
    kind: PoolKind
    axes: tuple[_AxisKeys, ...]
    #: An axis that leads the others when all its keys are present (agg mode's ISL).
    optional_axis: _AxisKeys | None = None

    @property
    def section(self) -> str:
        return f"{self.kind}_pool_selection_strategy"

    @property
    def mapping_key(self) -> str:
        return f"{self.kind}_pool_mapping"


_PREFILL = _StrategyKeys("prefill", (_ISL, _TTFT))
_DECODE = _StrategyKeys("decode", (_CONTEXT, _ITL))
_AGG = _StrategyKeys("agg", (_TTFT, _ITL), optional_axis=_ISL)

_MODES: dict[str, tuple[_StrategyKeys, ...]] = {"disagg": (_PREFILL, _DECODE), "agg": (_AGG,)}


def _pool_keys(kind: PoolKind) -> set[str]:
    return {f"num_{kind}_pools", f"{kind}_pool_dynamo_namespaces", f"{kind}_pool_priorities",
            f"{kind}_pool_selection_strategy"}


_TOP_KEYS = ({"mode", "enable_priority_retry", "tandem"}
             | _pool_keys("prefill") | _pool_keys("decode") | _pool_keys("agg"))
_OVERRIDE_KEYS = {"min_priority", "max_priority", "target_pool"}
_TANDEM_KEYS = {"default_ttft_target_ms", "default_itl_target_ms", "typical_osl_cap"}
_MISSING = object()


def _show(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _error(path: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{path} {message}", param=path)


class _Section:
    """A JSON object being read, with the path that error messages name."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, Mapping):
            raise InvalidRequest(f"{path or 'grid config'} must be a JSON object, "
                                 f"got {_show(data)}", param=path or None)
        self.data: Mapping[str, object] = data
        self.path = path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data

    def reject_unknown(self, allowed: set[str]) -> None:
        unknown = sorted(str(k) for k in self.data if k not in allowed)
        if not unknown:
            return
        named = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            named.append(self.at(key) + (f" (did you mean {close[0]}?)" if close else ""))
        raise InvalidRequest(f"unknown key{'s' if len(unknown) > 1 else ''}: {', '.join(named)}",
                             param=self.at(unknown[0]))

    def raw(self, key: str, alias: str | None = None, default: object = _MISSING
            ) -> tuple[object, str]:
        """The value of ``key`` (or its deprecated ``alias``) and the key it was read from."""
        if key in self.data:
            if alias is not None and alias in self.data and self.data[alias] != self.data[key]:
                raise _error(self.at(key), f"and its deprecated alias {alias} are set to "
                             f"different values ({_show(self.data[key])} vs "
                             f"{_show(self.data[alias])}); keep only {key}")
            return self.data[key], key
        if alias is not None and alias in self.data:
            log.warning("grid config: %s is deprecated; use %s", self.at(alias), self.at(key))
            return self.data[alias], alias
        if default is _MISSING:
            also = f" (or its deprecated alias {alias})" if alias else ""
            raise _error(self.at(key), f"is required{also}")
        return default, key

    def number(self, key: str, alias: str | None = None) -> tuple[float, str]:
        value, used = self.raw(key, alias)
        return _number(value, self.at(used)), used

    def integer(self, key: str, minimum: int | None = None) -> int:
        value, _ = self.raw(key)
        return _integer(value, self.at(key), minimum)


def _number(value: object, path: str) -> float:
    # bool is an int subclass; JSON true is not a number. Python's json also reads NaN/Infinity.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _error(path, f"must be a number, got {_show(value)}")
    if value != value or value in (float("inf"), float("-inf")):
        raise _error(path, f"must be a finite number, got {_show(value)}")
    return value


def _integer(value: object, path: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(path, f"must be an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise _error(path, f"must be >= {minimum}, got {value}")
    return value


def _list(value: object, path: str) -> list[object]:
    if not isinstance(value, list):
        raise _error(path, f"must be a list, got {_show(value)}")
    return value


def load_grid_config(data: Mapping[str, object]) -> GridConfig:
    """Validates a parsed config and builds the GridConfig (see the module docstring).

    Raises InvalidRequest naming the offending key by its path, also in ``param``.
    """
    top = _Section(data, "")
    top.reject_unknown(_TOP_KEYS)
    mode_value, _ = top.raw("mode", default="disagg")
    if not isinstance(mode_value, str) or mode_value not in _MODES:
        raise _error("mode", f"must be 'disagg' or 'agg', got {_show(mode_value)}")
    mode: Mode = "agg" if mode_value == "agg" else "disagg"
    retry, _ = top.raw("enable_priority_retry", default=False)
    if not isinstance(retry, bool):
        raise _error("enable_priority_retry", f"must be true or false, got {_show(retry)}")
    ignored = sorted(k for spec in _MODES["agg" if mode == "disagg" else "disagg"]
                     for k in _pool_keys(spec.kind) if top.has(k))
    if ignored:
        log.info("grid config in %s mode ignores %s", mode, ", ".join(ignored))
    pool_sets = {spec.kind: _pool_set(top, spec, mode) for spec in _MODES[mode]}
    options = _options(top.raw("tandem", default={})[0])
    return GridConfig(mode=mode, enable_priority_retry=retry, prefill=pool_sets.get("prefill"),
                      decode=pool_sets.get("decode"), agg=pool_sets.get("agg"), options=options)


def read_grid_config_file(path: str | os.PathLike[str]) -> GridConfig:
    """Reads and validates a JSON config file. Raises OSError if it cannot be read,
    InvalidRequest if it is not valid JSON or not a valid config."""
    return load_grid_config(read_json_file(path, "grid config"))


def _pool_set(top: _Section, spec: _StrategyKeys, mode: Mode) -> PoolSet:
    kind = spec.kind
    num_key = f"num_{kind}_pools"
    if not top.has(num_key):
        raise _error(num_key, f"is required in {mode} mode")
    num_pools = top.integer(num_key, minimum=1)

    names: tuple[str, ...] | None = None
    names_key = f"{kind}_pool_dynamo_namespaces"
    if top.has(names_key):
        items = _list(top.data[names_key], names_key)
        if len(items) != num_pools:
            raise _error(names_key, f"has {len(items)} entries but {num_key} is {num_pools}")
        for i, name in enumerate(items):
            if not isinstance(name, str) or not name:
                raise _error(f"{names_key}[{i}]", f"must be a non-empty string, got {_show(name)}")
        names = tuple(str(n) for n in items)

    priorities = tuple(range(num_pools))
    prio_key = f"{kind}_pool_priorities"
    if top.has(prio_key):
        items = _list(top.data[prio_key], prio_key)
        if len(items) != num_pools:
            raise _error(prio_key, f"has {len(items)} entries but {num_key} is {num_pools}")
        priorities = tuple(_integer(p, f"{prio_key}[{i}]") for i, p in enumerate(items))

    if not top.has(spec.section):
        raise _error(spec.section, f"is required in {mode} mode")
    grid = _grid(_Section(top.data[spec.section], spec.section), spec, num_pools, num_key)
    return PoolSet(kind=kind, num_pools=num_pools, grid=grid, priorities=priorities, names=names)


def _grid(sec: _Section, spec: _StrategyKeys, num_pools: int, num_key: str) -> PoolGrid:
    allowed = {spec.mapping_key, "priority_overrides"}.union(*(a.keys for a in spec.axes))
    if spec.optional_axis is not None:
        allowed |= spec.optional_axis.keys
    sec.reject_unknown(allowed)

    axis_keys = list(spec.axes)
    extra = spec.optional_axis
    if extra is not None:
        present = [k for k in (extra.min_key, extra.max_key, extra.res_key) if sec.has(k)]
        if present and len(present) < 3:
            missing = [k for k in (extra.min_key, extra.max_key, extra.res_key) if k not in present]
            raise _error(sec.at(missing[0]), f"is required when {', '.join(present)} "
                         f"{'is' if len(present) == 1 else 'are'} set ({extra.min_key}, "
                         f"{extra.max_key} and {extra.res_key} go together)")
        if present:
            axis_keys.insert(0, extra)
    axes = tuple(_axis(sec, keys) for keys in axis_keys)

    mapping_path = sec.at(spec.mapping_key)
    value, _ = sec.raw(spec.mapping_key)
    cells: list[int] = []
    _read_cells(value, mapping_path, axes, axis_keys, sec, num_pools, num_key, cells)
    overrides = _overrides(sec, num_pools, num_key)
    return PoolGrid(axes=axes, cells=tuple(cells), priority_overrides=overrides)


def _axis(sec: _Section, keys: _AxisKeys) -> Axis:
    lo, lo_key = sec.number(keys.min_key, keys.min_alias)
    hi, hi_key = sec.number(keys.max_key, keys.max_alias)
    resolution = sec.integer(keys.res_key, minimum=1)
    if lo >= hi:
        raise _error(sec.at(lo_key), f"({_show(lo)}) must be less than {sec.at(hi_key)} "
                     f"({_show(hi)})")
    return Axis(keys.name, lo, hi, resolution)


def _read_cells(value: object, path: str, axes: tuple[Axis, ...], axis_keys: list[_AxisKeys],
                sec: _Section, num_pools: int, num_key: str, out: list[int]) -> None:
    """Flattens a nested mapping row-major into ``out``, checking shape and pool indices."""
    depth = len(axes) - len(axis_keys)
    items = _list(value, path)
    axis, keys = axes[depth], axis_keys[0]
    if len(items) != axis.resolution:
        what = "rows" if depth == 0 else "entries"
        raise _error(path, f"has {len(items)} {what} but {sec.at(keys.res_key)} is "
                     f"{axis.resolution}")
    for i, item in enumerate(items):
        at = f"{path}[{i}]"
        if len(axis_keys) > 1:
            _read_cells(item, at, axes, axis_keys[1:], sec, num_pools, num_key, out)
            continue
        pool = _integer(item, at)
        if not 0 <= pool < num_pools:
            raise _error(at, f"= {pool} is not a pool index ({num_key} is {num_pools})")
        out.append(pool)


def _overrides(sec: _Section, num_pools: int, num_key: str) -> tuple[PriorityOverride, ...]:
    path = sec.at("priority_overrides")
    rules: list[PriorityOverride] = []
    for i, item in enumerate(_list(sec.raw("priority_overrides", default=[])[0], path)):
        rule = _Section(item, f"{path}[{i}]")
        rule.reject_unknown(_OVERRIDE_KEYS)
        lo, hi = rule.integer("min_priority"), rule.integer("max_priority")
        target = rule.integer("target_pool")
        if lo > hi:
            raise _error(rule.at("min_priority"), f"({lo}) must be <= "
                         f"{rule.at('max_priority')} ({hi})")
        if not 0 <= target < num_pools:
            raise _error(rule.at("target_pool"), f"= {target} is not a pool index "
                         f"({num_key} is {num_pools})")
        if _covered(lo, hi, [(r.min_priority, r.max_priority) for r in rules]):
            raise _error(rule.path, f"(priorities {lo}..{hi}) can never match: earlier rules "
                         "cover its whole range and the first matching rule wins")
        rules.append(PriorityOverride(lo, hi, target))
    return tuple(rules)


def _covered(lo: int, hi: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether the inclusive integer ranges cover every integer in ``[lo, hi]``."""
    nxt = lo
    for a, b in sorted(ranges):
        if b < nxt:
            continue
        if a > nxt:
            return False
        nxt = b + 1
        if nxt > hi:
            return True
    return nxt > hi


def _options(value: object) -> TandemGridOptions:
    sec = _Section(value, "tandem")
    sec.reject_unknown(_TANDEM_KEYS)
    targets: dict[str, float | None] = {}
    for key in ("default_ttft_target_ms", "default_itl_target_ms"):
        raw, _ = sec.raw(key, default=None)
        targets[key] = None if raw is None else _number(raw, sec.at(key))
        if (target := targets[key]) is not None and target < 0:
            raise _error(sec.at(key), f"must be >= 0, got {_show(target)}")
    cap_raw, _ = sec.raw("typical_osl_cap", default=None)
    cap = None if cap_raw is None else _integer(cap_raw, sec.at("typical_osl_cap"), minimum=0)
    return TandemGridOptions(default_ttft_target_ms=targets["default_ttft_target_ms"],
                             default_itl_target_ms=targets["default_itl_target_ms"],
                             typical_osl_cap=cap)
