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
from tandem.routing.prefix_index import PrefixIndex, TierOverlap
from tandem.routing.workers import RouteContext, WorkerState

#: A ranked candidate: the worker and how many leading prompt blocks it already holds (in
#: either KV tier: host-tier blocks are copied back, not recomputed).
Ranked = list[tuple[WorkerState, int]]

#: Default cost of a host-tier hit, as a share of recomputing the block (KvPolicy).
#: Onboarding a block moves its KV over the host link while recomputing it runs the model over
#: its tokens. For a Llama-3-8B layout (128 KiB of bf16 KV per token) over PCIe 4 x16 from
#: pinned memory (~25 GB/s) a token's KV takes ~5 us to copy, against ~15 us to prefill
#: (Dynamo mocker's prefill model, 1.5e-2 ms per token, fitted on an 8B model on one GPU):
#: about a third. PCIe 5 or NVLink-C2C hosts copy faster (toward 0.1); 0.3 errs toward the
#: device hit, which costs no copy and no host-link time shared with offloads.
DEFAULT_HOST_HIT_COST = 0.3


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
        overlap = device_blocks + (1 - host_hit_cost) * host_blocks
        cost = prefill_load_scale * max(active_prefill_blocks + new_prompt_blocks
                                        - overlap, 0) + active_decode_blocks

    device_blocks and host_blocks are the worker's leading-block match in the prefix index (a
    device run, then a host-tier run the worker copies back): a host hit costs host_hit_cost of
    a recomputed block, a device hit nothing. Lowest cost first;
    equal costs by fewer active requests, then at random. With temperature > 0 the first choice
    is sampled with p ~ exp(-c' / temperature), c' being the cost rescaled to [0, 1] over the
    candidates (all equal: uniform), so the temperature means the same at any load level; the
    rest follow by cost.

    Args:
        index: the pool's prefix index, fed by its workers' KV events.
        prefill_load_scale: weight of prefill work against decode work (>= 0); 0 ignores the
            prefix cache and balances on decode blocks alone.
        host_hit_cost: cost of a host-tier hit relative to recomputing the block, 0..1
            (DEFAULT_HOST_HIT_COST says why 0.3).
        temperature: 0 for the deterministic minimum; > 0 for softmax sampling.
        seed: seeds tie-breaking and sampling.
    Raises:
        InvalidRequest: a negative prefill_load_scale or temperature, a host_hit_cost outside
            0..1.
    """

    def __init__(self, index: PrefixIndex, prefill_load_scale: float = 1.0,
                 temperature: float = 0.0, seed: int | None = None,
                 host_hit_cost: float = DEFAULT_HOST_HIT_COST) -> None:
        if not 0 <= host_hit_cost <= 1:
            raise InvalidRequest(f"host_hit_cost must be within 0..1, got {host_hit_cost}",
                                 param="host_hit_cost")
        if not prefill_load_scale >= 0:
            raise InvalidRequest(f"prefill_load_scale must be >= 0, got {prefill_load_scale}",
                                 param="prefill_load_scale")
        if not temperature >= 0:
            raise InvalidRequest(f"temperature must be >= 0, got {temperature}",
                                 param="temperature")
        self.index = index
        self.prefill_load_scale = prefill_load_scale
        self.temperature = temperature
        self.host_hit_cost = host_hit_cost
        self._rng = random.Random(seed)

    def cost(self, worker: WorkerState, ctx: RouteContext,
             overlap_blocks: int | TierOverlap) -> float:
        """The cost formula above for one worker (an int overlap is all device blocks)."""
        overlap = (TierOverlap(overlap_blocks, 0) if isinstance(overlap_blocks, int)
                   else overlap_blocks)
        new_blocks = max(len(ctx.block_hashes), -(-ctx.isl // worker.block_size))
        saved = overlap.device + (1 - self.host_hit_cost) * overlap.host
        prefill = max(worker.active_prefill_blocks + new_blocks - saved, 0)
        return self.prefill_load_scale * prefill + worker.active_decode_blocks

    def rank(self, workers: Sequence[WorkerState], ctx: RouteContext) -> Ranked:
        candidates = _healthy(workers)
        if not candidates:
            return []
        overlaps = self.index.overlaps_by_tier(ctx.block_hashes)
        rnd = self._rng.random
        scored = []
        none = TierOverlap(0, 0)
        for w in candidates:
            overlap = overlaps.get(w.worker_id, none)
            scored.append((self.cost(w, ctx, overlap), w.active_requests, rnd(), w,
                           overlap.total))
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
