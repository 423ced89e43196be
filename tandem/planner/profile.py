"""What one worker of a pool can carry within a latency target: a capacity profile measured
offline (what `tandem profile` writes), read as JSON, and interpolated.

The JSON (version 1)::

    {"version": 1, "engine": "mock", "model": "demo", "gpus_per_worker": 1,
     "prefill": [{"isl": 1024, "tokens_per_s": 8000, "ttft_ms": 120}, ...],
     "decode": [{"context_length": 1124, "batch_size": 16, "itl_ms": 9.5}, ...]}

A prefill point is one steady run at a prompt load: prompts of ``isl`` tokens arriving at
``tokens_per_s`` prompt tokens per second, and the TTFT that came out. A decode point is one run
at ``batch_size`` concurrent streams of about ``context_length`` tokens each, and the ITL. Both
latencies are p90 over the run: the statistic of the SLA targets and of tandem.planner.observe.

Interpolation is linear, first along the load at each measured ISL (context length), then
between the two measured ISLs (context lengths) around the one asked for. Outside the measured
range it holds the nearest edge: no extrapolation, so a profile should cover the ISLs and context
lengths the pool serves and reach loads past its targets. Online refinement (Correction) scales
the latency the profile predicts by what the live pool shows.
"""
from __future__ import annotations

import bisect
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from tandem.errors import InvalidRequest
from tandem.jsonfile import read_json_file

PROFILE_VERSION = 1
#: One interval's observed/predicted ratio is clamped to [1/4, 4] before it enters the
#: correction, so that one odd interval (a cold cache, a burst) cannot swing it far.
_MAX_RATIO = 4.0

#: (load, latency ms) points of one curve, sorted by load.
Curve = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class PrefillPoint:
    #: Prompt length of every request of the run, tokens.
    isl: int
    #: Prompt tokens per second offered to the worker.
    tokens_per_s: float
    #: p90 time to first token at that load, ms.
    ttft_ms: float


@dataclass(frozen=True)
class DecodePoint:
    #: Tokens each stream held in its KV cache, on average over the run.
    context_length: int
    #: Streams decoding at once.
    batch_size: int
    #: p90 inter-token latency at that batch, ms.
    itl_ms: float


@dataclass(frozen=True)
class WorkerProfile:
    """The measured curves of one worker. Build with `profile_from_dict` (which validates)."""

    engine: str
    model: str
    gpus_per_worker: int
    prefill: tuple[PrefillPoint, ...] = ()
    decode: tuple[DecodePoint, ...] = ()

    def max_prefill_tokens_per_s(self, isl: float, ttft_target_ms: float) -> float:
        """Most prompt tokens per second one worker takes at `isl` with its p90 TTFT within
        the target; 0 when even the lightest measured load misses it. Raises ValueError when
        the profile has no prefill points."""
        return _across(self._prefill_curves(), isl, lambda c: _capacity(c, ttft_target_ms))

    def max_decode_streams(self, context_length: float, itl_target_ms: float) -> float:
        """Most concurrent streams one worker decodes at `context_length` with its p90 ITL
        within the target (fractional: interpolated between measured batch sizes); 0 when even
        the smallest measured batch misses it. Raises ValueError without decode points."""
        return _across(self._decode_curves(), context_length,
                       lambda c: _capacity(c, itl_target_ms))

    def ttft_ms(self, isl: float, tokens_per_s: float) -> float | None:
        """The p90 TTFT the profile predicts at this load; None past the heaviest measured
        load (the profile cannot say)."""
        return _across_optional(self._prefill_curves(), isl, lambda c: _latency(c, tokens_per_s))

    def itl_ms(self, context_length: float, streams: float) -> float | None:
        """The p90 ITL the profile predicts at this batch; None past the largest measured."""
        return _across_optional(self._decode_curves(), context_length,
                                lambda c: _latency(c, streams))

    def _prefill_curves(self) -> dict[float, Curve]:
        if not self.prefill:
            raise ValueError(f"the {self.engine} profile of {self.model} has no prefill points")
        return _curves((p.isl, p.tokens_per_s, p.ttft_ms) for p in self.prefill)

    def _decode_curves(self) -> dict[float, Curve]:
        if not self.decode:
            raise ValueError(f"the {self.engine} profile of {self.model} has no decode points")
        return _curves((p.context_length, p.batch_size, p.itl_ms) for p in self.decode)

    def to_dict(self) -> dict[str, object]:
        return {"version": PROFILE_VERSION, "engine": self.engine, "model": self.model,
                "gpus_per_worker": self.gpus_per_worker,
                "prefill": [asdict(p) for p in self.prefill],
                "decode": [asdict(p) for p in self.decode]}


@dataclass(frozen=True)
class Correction:
    """How much slower (factor > 1) or faster (< 1) the live pool runs than its profile says.

    Rule: each interval with traffic, r = observed p90 / profile's p90 at the observed load per
    worker, clamped to [1/4, 4]; factor <- (1 - alpha) * factor + alpha * r (an exponential
    moving average: alpha 0.3 gives the newest interval 30% and halves an old one's weight
    about every two intervals). Latency is taken to scale by the factor at every load, so the
    capacity within a target T is the profile's capacity within T / factor.
    """

    factor: float = 1.0

    def updated(self, observed_ms: float, predicted_ms: float, alpha: float) -> Correction:
        if not (observed_ms > 0 and predicted_ms > 0) or alpha == 0:
            return self
        ratio = min(max(observed_ms / predicted_ms, 1 / _MAX_RATIO), _MAX_RATIO)
        return Correction((1 - alpha) * self.factor + alpha * ratio)

    def target(self, target_ms: float) -> float:
        """The target to read the profile at."""
        return target_ms / self.factor


def profile_from_dict(data: Mapping[str, object]) -> WorkerProfile:
    """Validates parsed profile JSON. Raises InvalidRequest naming the key at fault."""
    if not isinstance(data, Mapping):
        raise InvalidRequest("a profile must be a JSON object")
    unknown = sorted(set(data) - {"version", "engine", "model", "gpus_per_worker", "prefill",
                                  "decode"})
    if unknown:
        raise InvalidRequest(f"profile: unknown key {unknown[0]}", param=unknown[0])
    if data.get("version") != PROFILE_VERSION:
        raise InvalidRequest(f"profile: version must be {PROFILE_VERSION}, got "
                             f"{data.get('version')!r}", param="version")
    engine, model = data.get("engine", ""), data.get("model", "")
    if not isinstance(engine, str) or not isinstance(model, str):
        raise InvalidRequest("profile: engine and model must be strings", param="engine")
    gpus = _positive(data.get("gpus_per_worker", 1), "gpus_per_worker", integer=True)
    prefill = tuple(PrefillPoint(int(_positive(p.get("isl"), f"{at}.isl", integer=True)),
                                 _positive(p.get("tokens_per_s"), f"{at}.tokens_per_s"),
                                 _positive(p.get("ttft_ms"), f"{at}.ttft_ms"))
                    for at, p in _points(data, "prefill", ("isl", "tokens_per_s", "ttft_ms")))
    decode = tuple(DecodePoint(int(_positive(p.get("context_length"), f"{at}.context_length",
                                             integer=True)),
                               int(_positive(p.get("batch_size"), f"{at}.batch_size",
                                             integer=True)),
                               _positive(p.get("itl_ms"), f"{at}.itl_ms"))
                   for at, p in _points(data, "decode", ("context_length", "batch_size", "itl_ms")))
    for name, keys in (("prefill", [(p.isl, p.tokens_per_s) for p in prefill]),
                       ("decode", [(p.context_length, p.batch_size) for p in decode])):
        if len(set(keys)) != len(keys):
            raise InvalidRequest(f"profile: {name} measures one load twice", param=name)
    if not prefill and not decode:
        raise InvalidRequest("profile: no prefill or decode points", param="prefill")
    return WorkerProfile(engine, model, int(gpus), prefill, decode)


def read_profile(path: str | os.PathLike[str]) -> WorkerProfile:
    """Reads a profile JSON file. Raises OSError if unreadable, InvalidRequest if invalid."""
    return profile_from_dict(read_json_file(path, "profile"))


def write_profile(profile: WorkerProfile, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_dict(), f, indent=1)
        f.write("\n")


def _points(data: Mapping[str, object], key: str, fields: tuple[str, ...]
            ) -> list[tuple[str, Mapping[str, object]]]:
    items = data.get(key, [])
    if not isinstance(items, list):
        raise InvalidRequest(f"profile: {key} must be a list", param=key)
    out = []
    for i, item in enumerate(items):
        at = f"{key}[{i}]"
        if not isinstance(item, Mapping) or set(item) != set(fields):
            raise InvalidRequest(f"profile: {at} must be an object with exactly "
                                 f"{', '.join(fields)}", param=at)
        out.append((at, item))
    return out


def _positive(value: object, at: str, integer: bool = False) -> float:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < float("inf"):
        what = "a positive integer" if integer else "a positive number"
        raise InvalidRequest(f"profile: {at} must be {what}, got {value!r}", param=at)
    return float(value)


def _curves(points: Iterable[tuple[float, float, float]]) -> dict[float, Curve]:
    """(key, load, latency) points grouped by key (ISL or context length), each sorted."""
    by_key: dict[float, list[tuple[float, float]]] = {}
    for key, load, latency in points:
        by_key.setdefault(float(key), []).append((float(load), float(latency)))
    return {key: tuple(sorted(curve)) for key, curve in sorted(by_key.items())}


def _capacity(curve: Curve, target_ms: float) -> float:
    """The load where the curve first crosses the target, walking up from the lightest load
    (a later dip under the target is noise and is not trusted); the heaviest load if it never
    does; 0 if the lightest load already misses it."""
    if curve[0][1] > target_ms:
        return 0.0
    for (l0, t0), (l1, t1) in zip(curve, curve[1:]):
        if t1 > target_ms:
            return l0 + (target_ms - t0) / (t1 - t0) * (l1 - l0)
    return curve[-1][0]


def _latency(curve: Curve, load: float) -> float | None:
    if load <= curve[0][0]:
        return curve[0][1]
    for (l0, t0), (l1, t1) in zip(curve, curve[1:]):
        if load <= l1:
            return t0 + (load - l0) / (l1 - l0) * (t1 - t0)
    return None


def _across(curves: Mapping[float, Curve], x: float, read: Callable[[Curve], float]) -> float:
    value = _across_optional(curves, x, read)
    assert value is not None
    return value


def _across_optional(curves: Mapping[float, Curve], x: float,
                     read: Callable[[Curve], float | None]) -> float | None:
    """`read` at key x, interpolated linearly between the measured keys around it."""
    keys: Sequence[float] = list(curves)
    i = bisect.bisect_left(keys, x)
    if i < len(keys) and keys[i] == x or i == 0 or i == len(keys):
        return read(curves[keys[min(i, len(keys) - 1)]])
    lo, hi = read(curves[keys[i - 1]]), read(curves[keys[i]])
    if lo is None or hi is None:
        return None
    w = (x - keys[i - 1]) / (keys[i] - keys[i - 1])
    return lo + w * (hi - lo)
