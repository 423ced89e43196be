"""Worker policies: how a pool orders its candidate workers for one request.

Every policy ranks; none mutates load. The caller hands the request to the first worker (and
calls `WorkerState.hand_out`), keeping the rest as fallbacks. Policies are picked by name from
`POLICIES` through `create_policy`.
"""
from __future__ import annotations

import inspect
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence

from tandem.errors import InvalidRequest
from tandem.routing.prefix_index import PrefixIndex
from tandem.routing.workers import RouteContext, WorkerState

#: A ranked candidate: the worker and how many leading prompt blocks it already holds.
Ranked = list[tuple[WorkerState, int]]


class WorkerPolicy(ABC):
    """Orders a pool's candidates for one request.

    Contract for `rank`:
      - Returns every healthy worker of `workers` exactly once, best first, each with its
        overlap blocks (0 for policies that do not look at the prefix index). Unhealthy workers
        are skipped; an empty result means no candidate (the caller raises Unavailable).
      - Reads load (WorkerState.active_*) but never changes it.
      - Not thread-safe (round-robin position, random state): one caller at a time.
    """

    @abstractmethod
    def rank(self, workers: Sequence[WorkerState], ctx: RouteContext) -> Ranked:
        """The healthy workers of `workers`, best first, with their overlap blocks."""


def _healthy(workers: Sequence[WorkerState]) -> list[WorkerState]:
    return [w for w in workers if w.healthy]


def _load_key(worker: WorkerState) -> tuple[int, int]:
    """Fewest active requests, then fewest active blocks."""
    return worker.active_requests, worker.active_prefill_blocks + worker.active_decode_blocks


class RoundRobinPolicy(WorkerPolicy):
    """Candidates in turn: each call starts one place further along the candidate list."""

    def __init__(self) -> None:
        self._next = 0

    def rank(self, workers: Sequence[WorkerState], ctx: RouteContext) -> Ranked:
        candidates = _healthy(workers)
        if not candidates:
            return []
        start = self._next % len(candidates)
        self._next += 1
        return [(w, 0) for w in candidates[start:] + candidates[:start]]


class RandomPolicy(WorkerPolicy):
    """A uniformly random order; `seed` makes it reproducible."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, workers: Sequence[WorkerState], ctx: RouteContext) -> Ranked:
        candidates = _healthy(workers)
        self._rng.shuffle(candidates)
        return [(w, 0) for w in candidates]


class LeastLoadedPolicy(WorkerPolicy):
    """Fewest active requests first, then fewest active blocks; exact ties in random order.

    Load includes what was handed out since the worker's last report, so a burst spreads.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, workers: Sequence[WorkerState], ctx: RouteContext) -> Ranked:
        rnd = self._rng.random
        ordered = sorted(_healthy(workers), key=lambda w: (*_load_key(w), rnd()))
        return [(w, 0) for w in ordered]


class PowerOfTwoPolicy(WorkerPolicy):
    """Samples two candidates and puts the less loaded first (load as in least_loaded), the
    other second; the remaining candidates follow as fallbacks, least loaded first.

    Cheaper than a full scan in spirit, and it avoids the herd that least_loaded causes when
    many routers act on the same stale load.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, workers: Sequence[WorkerState], ctx: RouteContext) -> Ranked:
        candidates = _healthy(workers)
        if len(candidates) <= 1:
            return [(w, 0) for w in candidates]
        rnd = self._rng.random
        i, j = self._rng.sample(range(len(candidates)), 2)
        pair = sorted((candidates[i], candidates[j]), key=lambda w: (*_load_key(w), rnd()))
        rest = [w for k, w in enumerate(candidates) if k != i and k != j]
        rest.sort(key=lambda w: (*_load_key(w), rnd()))
        return [(w, 0) for w in pair + rest]


class KvPolicy(WorkerPolicy):
    """KV-aware: the lowest estimated cost of serving the request, prefix reuse included.

        new_prompt_blocks = max(len(ctx.block_hashes), ceil(ctx.isl / worker.block_size))
        cost = prefill_load_scale * max(active_prefill_blocks + new_prompt_blocks
                                        - overlap_blocks, 0) + active_decode_blocks

    overlap_blocks is the worker's leading-block match in the prefix index. Lowest cost first;
    equal costs by fewer active requests, then at random. With temperature > 0 the first choice
    is sampled with p ~ exp(-c' / temperature), c' being the cost rescaled to [0, 1] over the
    candidates (all equal: uniform), so the temperature means the same at any load level; the
    rest follow by cost.

    Args:
        index: the pool's prefix index, fed by its workers' KV events.
        prefill_load_scale: weight of prefill work against decode work (>= 0); 0 ignores the
            prefix cache and balances on decode blocks alone.
        temperature: 0 for the deterministic minimum; > 0 for softmax sampling.
        seed: seeds tie-breaking and sampling.
    Raises:
        InvalidRequest: a negative prefill_load_scale or temperature.
    """

    def __init__(self, index: PrefixIndex, prefill_load_scale: float = 1.0,
                 temperature: float = 0.0, seed: int | None = None) -> None:
        if not prefill_load_scale >= 0:
            raise InvalidRequest(f"prefill_load_scale must be >= 0, got {prefill_load_scale}",
                                 param="prefill_load_scale")
        if not temperature >= 0:
            raise InvalidRequest(f"temperature must be >= 0, got {temperature}",
                                 param="temperature")
        self.index = index
        self.prefill_load_scale = prefill_load_scale
        self.temperature = temperature
        self._rng = random.Random(seed)

    def cost(self, worker: WorkerState, ctx: RouteContext, overlap_blocks: int) -> float:
        """The cost formula above for one worker."""
        new_blocks = max(len(ctx.block_hashes), -(-ctx.isl // worker.block_size))
        prefill = max(worker.active_prefill_blocks + new_blocks - overlap_blocks, 0)
        return self.prefill_load_scale * prefill + worker.active_decode_blocks

    def rank(self, workers: Sequence[WorkerState], ctx: RouteContext) -> Ranked:
        candidates = _healthy(workers)
        if not candidates:
            return []
        overlaps = self.index.overlaps(ctx.block_hashes)
        rnd = self._rng.random
        scored = []
        for w in candidates:
            overlap = overlaps.get(w.worker_id, 0)
            scored.append((self.cost(w, ctx, overlap), w.active_requests, rnd(), w, overlap))
        scored.sort(key=lambda s: s[:3])
        if self.temperature > 0 and len(scored) > 1:
            first = self._sample(scored)
            scored.insert(0, scored.pop(first))
        return [(s[3], s[4]) for s in scored]

    def _sample(self, scored: list[tuple[float, int, float, WorkerState, int]]) -> int:
        """Index into `scored` (sorted by cost) drawn by softmax over normalised -cost."""
        lo, hi = scored[0][0], scored[-1][0]
        if hi == lo:
            return self._rng.randrange(len(scored))
        span = (hi - lo) * self.temperature
        weights = [math.exp(-(s[0] - lo) / span) for s in scored]
        return self._rng.choices(range(len(scored)), weights=weights)[0]


#: Worker policies by name.
POLICIES: dict[str, type[WorkerPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "least_loaded": LeastLoadedPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "kv": KvPolicy,
}


def create_policy(name: str, **config: object) -> WorkerPolicy:
    """Builds the named policy from its keyword config (e.g. `kv` needs `index=`).

    Raises:
        InvalidRequest: an unknown name (the message lists the supported ones), or a config
            key the policy does not take or a required one missing (the message names it).
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidRequest(f"unknown worker policy '{name}'; supported: "
                             f"{', '.join(sorted(POLICIES))}", param="policy")
    try:
        inspect.signature(cls).bind(**config)
    except TypeError as e:
        raise InvalidRequest(f"worker policy '{name}': {e}", param="policy") from None
    return cls(**config)  # type: ignore[arg-type]
