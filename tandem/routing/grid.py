"""Grid pool selection, the router's first level: which pool suits a request's size and targets.

The model mirrors NVIDIA Dynamo's global router (``components/src/dynamo/global_router/
pool_selection.py`` and ``docs/fern/components/router/global-router-config-reference.mdx``), so a
Dynamo config loads unchanged (tandem.routing.grid_config reads and validates it):

- prefill (disagg mode): ``prefill_pool_mapping[isl_idx][ttft_idx]``;
- decode (disagg mode): ``decode_pool_mapping[context_length_idx][itl_idx]``;
- aggregated (agg mode): ``agg_pool_mapping[ttft_idx][itl_idx]``, or
  ``agg_pool_mapping[isl_idx][ttft_idx][itl_idx]`` when the optional ``isl_*`` keys are set.

Per axis, ``idx = clamp(int((x - min) / ((max - min) / resolution)), 0, resolution - 1)``. A
``priority_overrides`` rule whose inclusive ``[min_priority, max_priority]`` range holds the
request's priority replaces the grid's pick (first matching rule wins). With
``enable_priority_retry`` the pools to try next, while nothing has streamed, are the strictly
faster ones (lower ``*_pool_priorities`` value), slowest first.

Where Tandem differs from Dynamo, on purpose:
- Missing targets fall back to ``tandem.default_ttft_target_ms`` / ``default_itl_target_ms`` (Dynamo
  takes these as the CLI flags ``--default-ttft-target-ms`` / ``--default-itl-target-ms``), then to
  the midpoint of the axis, as Dynamo does.
- The decode context length is ISL plus half the expected output (decode_context_length); Dynamo
  uses ISL alone and marks it a TODO.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tandem.errors import InvalidRequest

PoolKind = Literal["prefill", "decode", "agg"]
Mode = Literal["disagg", "agg"]


def axis_index(x: float, lo: float, hi: float, resolution: int) -> int:
    """The bucket of ``x`` on an axis of ``resolution`` equal buckets over ``[lo, hi)``.

    Exactly ``clamp(int((x - lo) / ((hi - lo) / resolution)), 0, resolution - 1)`` (Dynamo's
    formula, truncation included); infinities clamp to the ends instead of overflowing ``int``.

    Requires ``lo < hi`` and ``resolution >= 1`` (the config guarantees both).
    Raises ValueError if ``x`` is NaN.
    """
    q = (x - lo) / ((hi - lo) / resolution)
    if math.isnan(q):
        raise ValueError("axis value is NaN")
    if q >= resolution:
        return resolution - 1
    if q <= 0:
        return 0
    return int(q)


@dataclass(frozen=True, slots=True)
class Axis:
    """One dimension of a grid. ``name`` is the config's prefix (``isl``, ``ttft``, ...)."""

    name: str
    lo: float
    hi: float
    resolution: int

    @property
    def midpoint(self) -> float:
        """Where a missing target lands when no default is configured (Dynamo's fallback)."""
        return (self.lo + self.hi) / 2

    def index(self, x: float) -> int:
        return axis_index(x, self.lo, self.hi, self.resolution)


@dataclass(frozen=True, slots=True)
class PriorityOverride:
    """Requests whose priority lies in ``[min_priority, max_priority]`` go to ``target_pool``."""

    min_priority: int
    max_priority: int
    target_pool: int

    def matches(self, priority: int) -> bool:
        return self.min_priority <= priority <= self.max_priority


def retry_order(selected: int, pool_priorities: Sequence[int], enabled: bool) -> tuple[int, ...]:
    """The selected pool, then (when ``enabled``) every strictly faster pool, slowest first.

    Lower priority values are faster; pools that share a value keep index order; pools as slow as
    the selected one are not tried (Dynamo's ``get_priority_retry_order``). With priorities
    ``[0, 1, 2]`` a request placed on pool 2 tries 2, then 1, then 0.
    """
    if not enabled:
        return (selected,)
    own = pool_priorities[selected]
    order = [selected]
    for level in sorted({p for p in pool_priorities if p < own}, reverse=True):
        order.extend(i for i, p in enumerate(pool_priorities) if p == level)
    return tuple(order)


@dataclass(frozen=True, slots=True)
class PoolGrid:
    """A grid of pool indices: ``axes`` in mapping order (row axis first), ``cells`` row-major."""

    axes: tuple[Axis, ...]
    cells: tuple[int, ...]
    priority_overrides: tuple[PriorityOverride, ...] = ()

    def __post_init__(self) -> None:
        if len(self.cells) != math.prod(a.resolution for a in self.axes):
            raise ValueError("cells do not fill the grid")

    def cell(self, values: Sequence[float]) -> tuple[int, ...]:
        """Bucket indices of ``values``, one per axis, in axis order."""
        return tuple(axis.index(x) for axis, x in zip(self.axes, values, strict=True))

    def pool_at(self, cell: Sequence[int]) -> int:
        flat = 0
        for axis, idx in zip(self.axes, cell, strict=True):
            flat = flat * axis.resolution + idx
        return self.cells[flat]

    def mapping(self) -> list[object]:
        """The nested-list mapping as written in the config (for logs and round trips)."""
        def nest(offset: int, depth: int) -> list[object]:
            if depth == len(self.axes) - 1:
                return list(self.cells[offset:offset + self.axes[depth].resolution])
            stride = math.prod(a.resolution for a in self.axes[depth + 1:])
            return [nest(offset + i * stride, depth + 1)
                    for i in range(self.axes[depth].resolution)]
        return nest(0, 0)

    def override_for(self, priority: int | None) -> int | None:
        """Index of the first override rule that matches ``priority``; None without one."""
        if priority is None:
            return None
        for i, rule in enumerate(self.priority_overrides):
            if rule.matches(priority):
                return i
        return None


@dataclass(frozen=True, slots=True)
class PoolChoice:
    """Where a request goes: ``pool``, then ``retry_pools`` in order while nothing has streamed."""

    kind: PoolKind
    pool: int
    retry_pools: tuple[int, ...] = ()
    #: The grid cell the request fell in (indices in axis order), even when overridden.
    cell: tuple[int, ...] = ()
    #: The axis values used after fallbacks (e.g. ISL and the TTFT target actually applied).
    values: tuple[float, ...] = ()
    #: Index of the ``priority_overrides`` rule that replaced the grid's pick, if any.
    override_rule: int | None = None

    @property
    def pools(self) -> tuple[int, ...]:
        """Every pool to try, the pick first."""
        return (self.pool, *self.retry_pools)


@dataclass(frozen=True, slots=True)
class PoolSet:
    """The pools of one kind: how many, their grid, speed ranking and optional names."""

    kind: PoolKind
    num_pools: int
    grid: PoolGrid
    #: Per pool, lower is faster; defaults to pool order (pool 0 fastest), as in Dynamo.
    priorities: tuple[int, ...]
    #: Dynamo's ``*_pool_dynamo_namespaces``: names by pool index, when the config gives them.
    names: tuple[str, ...] | None = None

    def choose(self, values: Sequence[float], priority: int | None,
               enable_retry: bool) -> PoolChoice:
        """Grid lookup, then priority override, then the retry order of the final pool."""
        cell = self.grid.cell(values)
        pool = self.grid.pool_at(cell)
        rule = self.grid.override_for(priority)
        if rule is not None:
            pool = self.grid.priority_overrides[rule].target_pool
        order = retry_order(pool, self.priorities, enable_retry)
        return PoolChoice(kind=self.kind, pool=pool, retry_pools=order[1:], cell=cell,
                          values=tuple(values), override_rule=rule)


@dataclass(frozen=True, slots=True)
class TandemGridOptions:
    """Tandem-only settings, read from the config's optional ``"tandem"`` object.

    Dynamo ignores keys it does not know, so a config carrying this object still loads there.
    """

    #: Applied when a request has no TTFT target (prefill and agg). Dynamo: --default-ttft-target-ms.
    default_ttft_target_ms: float | None = None
    #: Applied when a request has no ITL target (decode and agg). Dynamo: --default-itl-target-ms.
    default_itl_target_ms: float | None = None
    #: Caps the expected output length in decode_context_length; None leaves it uncapped.
    typical_osl_cap: int | None = None


def decode_context_length(isl: int, expected_osl: int, typical_osl_cap: int | None) -> int:
    """The context length a decode pool is chosen by: ``isl + min(expected_osl, cap) // 2``.

    A decode worker holds the prompt plus the tokens generated so far; half the expected output is
    the average over the request's life. Dynamo uses ISL alone (a TODO in its handler), which
    sends long generations from short prompts to pools sized for short contexts.
    ``expected_osl`` is usually the request's ``max_tokens``, which clients often set far above
    what they get, hence the cap. Raises ValueError on negative arguments.
    """
    if isl < 0 or expected_osl < 0 or (typical_osl_cap is not None and typical_osl_cap < 0):
        raise ValueError("decode_context_length takes non-negative token counts")
    osl = expected_osl if typical_osl_cap is None else min(expected_osl, typical_osl_cap)
    return isl + osl // 2


def _target(name: str, value: float | None, default: float | None, axis: Axis) -> float:
    """The request's target, else the configured default, else the axis midpoint."""
    if value is None:
        return default if default is not None else axis.midpoint
    if math.isnan(value):
        raise InvalidRequest(f"{name} must be a number, not NaN", param=name)
    return value


@dataclass(frozen=True, slots=True)
class GridConfig:
    """A loaded global-router config: the mode, its pool sets and Tandem's options.

    Disagg mode has ``prefill`` and ``decode``; agg mode has ``agg``. Build it with
    tandem.routing.grid_config's load_grid_config or read_grid_config_file, which validate everything the selectors rely on.
    Selection is pure and thread-safe.
    """

    mode: Mode
    enable_priority_retry: bool = False
    prefill: PoolSet | None = None
    decode: PoolSet | None = None
    agg: PoolSet | None = None
    options: TandemGridOptions = field(default_factory=TandemGridOptions)

    def select_prefill_pool(self, isl: int, ttft_ms: float | None,
                            priority: int | None) -> PoolChoice:
        """Prefill pool for a prompt of ``isl`` tokens (disagg mode).

        ``ttft_ms`` None falls back to ``tandem.default_ttft_target_ms``, then the TTFT midpoint.
        Raises InvalidRequest if ``ttft_ms`` is NaN, ValueError outside disagg mode.
        """
        pools = self._pools(self.prefill, "select_prefill_pool")
        ttft_axis = pools.grid.axes[1]
        ttft = _target("ttft_ms", ttft_ms, self.options.default_ttft_target_ms, ttft_axis)
        return pools.choose((isl, ttft), priority, self.enable_priority_retry)

    def select_decode_pool(self, context_length: int, itl_ms: float | None,
                           priority: int | None) -> PoolChoice:
        """Decode pool for a request of ``context_length`` tokens (see decode_context_length).

        ``itl_ms`` None falls back to ``tandem.default_itl_target_ms``, then the ITL midpoint.
        Raises InvalidRequest if ``itl_ms`` is NaN, ValueError outside disagg mode.
        """
        pools = self._pools(self.decode, "select_decode_pool")
        itl_axis = pools.grid.axes[1]
        itl = _target("itl_ms", itl_ms, self.options.default_itl_target_ms, itl_axis)
        return pools.choose((context_length, itl), priority, self.enable_priority_retry)

    def select_agg_pool(self, ttft_ms: float | None, itl_ms: float | None, priority: int | None,
                        *, isl: int | None = None) -> PoolChoice:
        """Aggregated pool (agg mode) for the request's TTFT and ITL targets.

        ``isl`` is required when the grid has Dynamo's optional ISL axis and ignored otherwise.
        Missing targets fall back as in select_prefill_pool / select_decode_pool.
        Raises InvalidRequest if a target is NaN, ValueError outside agg mode or when the grid
        needs ``isl`` and it is None.
        """
        pools = self._pools(self.agg, "select_agg_pool")
        *isl_axes, ttft_axis, itl_axis = pools.grid.axes
        ttft = _target("ttft_ms", ttft_ms, self.options.default_ttft_target_ms, ttft_axis)
        itl = _target("itl_ms", itl_ms, self.options.default_itl_target_ms, itl_axis)
        values: tuple[float, ...] = (ttft, itl)
        if isl_axes:
            if isl is None:
                raise ValueError("this agg grid has an ISL axis; select_agg_pool needs isl")
            values = (isl, *values)
        return pools.choose(values, priority, self.enable_priority_retry)

    def decode_context_length(self, isl: int, expected_osl: int) -> int:
        """decode_context_length with this config's ``tandem.typical_osl_cap``."""
        return decode_context_length(isl, expected_osl, self.options.typical_osl_cap)

    def _pools(self, pools: PoolSet | None, caller: str) -> PoolSet:
        if pools is None:
            raise ValueError(f"{caller} does not apply to a grid config in {self.mode} mode")
        return pools
