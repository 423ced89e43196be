"""The planner's typed configuration: SLA targets and bounds per pool, a GPU budget, the interval,
the predictor, online refinement and hysteresis.

Read from a YAML (or JSON) mapping through tandem.runtime.config.build, as every service's config
is: unknown keys are rejected by their path (``pools[0].ttft_target_ms``), values must have their
field's type, and each class checks its own values on construction, raising InvalidRequest that
names the key. Example::

    interval_s: 30
    gpu_budget: 8
    pools:
      - {name: prefill, role: prefill, ttft_target_ms: 500, max_workers: 4,
         profile: profiles/prefill.json}
      - {name: decode, role: decode, itl_target_ms: 50, max_workers: 6,
         profile: profiles/decode.json}

Pool names are the deployment's (DeploymentPool.name), which the router's metrics carry in
their ``pool`` label.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import yaml

from tandem.errors import InvalidRequest
from tandem.runtime import config as config_lib

#: prefill and decode: the two halves of disaggregated serving; agg: workers that do both
#: (the router's and the worker's name for aggregated serving).
ROLES = ("prefill", "decode", "agg")


@dataclass(frozen=True)
class PlannerPoolConfig:
    """One pool the planner sizes: its role, its SLA targets and the bounds on its size."""

    #: The pool's name in the deployment (required, unique).
    name: str = ""
    #: prefill, decode or agg.
    role: str = "decode"
    #: p90 time to first token the pool must keep, ms (prefill and agg pools: required).
    ttft_target_ms: float = 0.0
    #: p90 inter-token latency the pool must keep, ms (decode and agg pools: required).
    itl_target_ms: float = 0.0
    #: Fewest workers, at least 1: a request that finds no worker fails, so the planner never
    #: scales a pool to zero.
    min_workers: int = 1
    #: Most workers.
    max_workers: int = 8
    #: GPUs each worker owns (its tensor-parallel size), counted against gpu_budget.
    gpus_per_worker: int = 1
    #: The capacity profile of one worker of this pool: a JSON file (tandem.planner.profile),
    #: a relative path being relative to the planner's working directory.
    profile: str = ""

    def __post_init__(self) -> None:
        where = f"planner pool '{self.name}'"
        if not self.name:
            raise InvalidRequest("every planner pool needs a name", param="pools.name")
        if self.role not in ROLES:
            raise InvalidRequest(f"{where}: role must be one of {', '.join(ROLES)}, got "
                                 f"'{self.role}'", param=f"{self.name}.role")
        for key, used in (("ttft_target_ms", self.uses_prefill),
                          ("itl_target_ms", self.uses_decode)):
            value = getattr(self, key)
            if used and not value > 0:
                raise InvalidRequest(f"{where}: a {self.role} pool needs {key} > 0, got {value}",
                                     param=f"{self.name}.{key}")
            if not used and value != 0:
                raise InvalidRequest(f"{where}: {key} does not apply to a {self.role} pool",
                                     param=f"{self.name}.{key}")
        if self.min_workers < 1:
            raise InvalidRequest(f"{where}: min_workers must be >= 1, got {self.min_workers}",
                                 param=f"{self.name}.min_workers")
        if self.max_workers < self.min_workers:
            raise InvalidRequest(f"{where}: max_workers ({self.max_workers}) must be >= "
                                 f"min_workers ({self.min_workers})",
                                 param=f"{self.name}.max_workers")
        if self.gpus_per_worker < 1:
            raise InvalidRequest(f"{where}: gpus_per_worker must be >= 1, got "
                                 f"{self.gpus_per_worker}", param=f"{self.name}.gpus_per_worker")

    @property
    def uses_prefill(self) -> bool:
        """Whether this pool's workers compute prompts (and answer to a TTFT target)."""
        return self.role in ("prefill", "agg")

    @property
    def uses_decode(self) -> bool:
        """Whether this pool's workers stream tokens (and answer to an ITL target)."""
        return self.role in ("decode", "agg")


@dataclass(frozen=True)
class HysteresisConfig:
    """When a pool may shrink. Growing is never delayed: a pool that wants more workers gets them
    in the interval it wants them (within max_workers and the GPU budget).

    The defaults return an idle pool to its minimum by the third decision after its load stops
    (the issue's bar), also right after a scale-up: the interval in which the load stops may
    still want more than the minimum, the next two want the minimum, and the third decision is
    past both the window and the cooldown.
    """

    #: A pool shrinks only when each of the last this many intervals wanted fewer workers than
    #: it has, and then to the most any of them wanted (Kubernetes' HPA stabilization window).
    scale_down_intervals: int = 2
    #: Shrinking counts demand this much higher (0.2: 20%), so that a demand that hovers at a
    #: whole number of workers does not flip between two counts. Why 0.2: Poisson arrivals at
    #: 10 req/s vary by ~6% between 30-s intervals, the predictor's trend makes that ~8%, and a
    #: pool needs a margin of two to three of those to stay put.
    scale_down_headroom: float = 0.2
    #: Decisions after a scale-up during which the pool does not shrink: its new workers are
    #: still starting and taking load, so the metrics do not yet show what they do. Not
    #: applied after a scale-down: a second step down is not a flap, and waiting there would
    #: slow the return to the minimum.
    cooldown_intervals: int = 2

    def __post_init__(self) -> None:
        if self.scale_down_intervals < 1:
            raise InvalidRequest("hysteresis.scale_down_intervals must be >= 1, got "
                                 f"{self.scale_down_intervals}",
                                 param="hysteresis.scale_down_intervals")
        if not 0 <= self.scale_down_headroom < 1:
            raise InvalidRequest("hysteresis.scale_down_headroom must be in [0, 1), got "
                                 f"{self.scale_down_headroom}",
                                 param="hysteresis.scale_down_headroom")
        if self.cooldown_intervals < 0:
            raise InvalidRequest("hysteresis.cooldown_intervals must be >= 0, got "
                                 f"{self.cooldown_intervals}",
                                 param="hysteresis.cooldown_intervals")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner: its pools, what they may spend together, and how it decides."""

    #: Seconds between two decisions (and the window each observation covers).
    interval_s: float = 30.0
    #: GPUs all planned pools may hold together; 0: no budget.
    gpu_budget: int = 0
    #: Intervals whose differences make the predictor's trend.
    predictor_window: int = 3
    #: Weight of the newest interval in a profile's online correction (0: no refinement;
    #: tandem.planner.profile.Correction gives the rule).
    correction_alpha: float = 0.3
    #: Seconds between two checks of the backlog between decisions (0: none): the frontends'
    #: requests in flight, when more than at the last decision and more than a pool's workers
    #: hold by its capacity model (by over hysteresis.scale_down_headroom), grow the pool at once
    #: to what they need, without waiting for the interval (tandem.planner.decision's fast
    #: scale-up). No check runs when it is not shorter than interval_s.
    scale_up_check_s: float = 3.0
    #: When a pool may shrink.
    hysteresis: HysteresisConfig = field(default_factory=HysteresisConfig)
    #: The pools the planner sizes (YAML only).
    pools: list[PlannerPoolConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise InvalidRequest(f"interval_s must be > 0, got {self.interval_s}",
                                 param="interval_s")
        if not 0 <= self.scale_up_check_s < float("inf"):
            raise InvalidRequest(f"scale_up_check_s must be >= 0 (0: no checks), got "
                                 f"{self.scale_up_check_s}", param="scale_up_check_s")
        if self.gpu_budget < 0:
            raise InvalidRequest(f"gpu_budget must be >= 0 (0: none), got {self.gpu_budget}",
                                 param="gpu_budget")
        if self.predictor_window < 1:
            raise InvalidRequest(f"predictor_window must be >= 1, got {self.predictor_window}",
                                 param="predictor_window")
        if not 0 <= self.correction_alpha <= 1:
            raise InvalidRequest(f"correction_alpha must be in [0, 1], got "
                                 f"{self.correction_alpha}", param="correction_alpha")
        names = [pool.name for pool in self.pools]
        if duplicates := sorted({n for n in names if names.count(n) > 1}):
            raise InvalidRequest(f"planner pool names must be unique; repeated: "
                                 f"{', '.join(duplicates)}", param="pools")
        floor = sum(pool.min_workers * pool.gpus_per_worker for pool in self.pools)
        if self.gpu_budget and floor > self.gpu_budget:
            raise InvalidRequest(f"gpu_budget ({self.gpu_budget}) is below the GPUs the pools "
                                 f"hold at their min_workers ({floor})", param="gpu_budget")

    def pool(self, name: str) -> PlannerPoolConfig:
        """The pool called `name`. Raises KeyError if there is none."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


def planner_config_from_dict(data: Mapping[str, object]) -> PlannerConfig:
    """Builds and validates a PlannerConfig from parsed YAML/JSON. Raises InvalidRequest naming
    the offending key, also when no pool is listed (a planner with no pools plans nothing)."""
    if not isinstance(data, Mapping):
        raise InvalidRequest(f"a planner config must be a mapping, got {type(data).__name__}")
    config = config_lib.build(PlannerConfig, dict(data))
    if not config.pools:
        raise InvalidRequest("a planner config must list at least one pool", param="pools")
    return config


def read_planner_config(path: str | os.PathLike[str]) -> PlannerConfig:
    """Reads a YAML (or JSON) planner config file. Raises OSError if it cannot be read,
    InvalidRequest if it is not YAML or not a valid config."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidRequest(f"planner config {os.fspath(path)} is not valid YAML: {e}") from None
    return planner_config_from_dict(data if data is not None else {})
