"""The router's decision: pool by SLA grid, worker by the pool's policy, load counted from the
moment a worker is handed out.

Pools come from RouterConfig. With a Dynamo grid config, the grid picks a pool (and a retry
order of faster pools) per request; without one, the first serving pool is the pick and the
others its retry order. The pick's fallbacks are the chosen pool's other workers in policy
order, then the best worker of each retry pool: the frontend walks them only while nothing has
streamed to the client.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.errors import InvalidRequest, Unavailable
from tandem.kv.hashing import block_hashes as hash_blocks
from tandem.routing.config import POOL_KINDS, WHOLE_REQUEST_KINDS, PoolConfig
from tandem.routing.grid import GridConfig
from tandem.routing.policies import WorkerPolicy, create_policy
from tandem.routing.prefix_index import PrefixIndex
from tandem.routing.snapshot import PoolSnapshot, WorkerSnapshot
from tandem.routing.workers import (
    RouteContext,
    RouteDecision,
    SlaHints,
    WorkerRef,
    WorkerState,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Handout:
    """What the router handed one worker for a request, taken back when the request completes:
    the blocks it expects the request to add to the worker's load, and the worker's report
    count then (a report after it already carries the request's load)."""

    worker: WorkerState
    prefill_blocks: int
    decode_blocks: int
    reports_then: int


@dataclass
class Pool:
    config: PoolConfig
    policy: WorkerPolicy
    workers: dict[str, WorkerState] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True, slots=True)
class RouteRequestInfo:
    request_id: str
    token_ids: Sequence[int]
    block_hashes: Sequence[int]
    isl: int
    expected_osl: int
    sla: SlaHints
    exclude_ids: Sequence[str] = ()
    #: With prefill pools: prompts whose part not cached on the decode pick is at most this
    #: many tokens are prefilled by the decode worker itself (no KV transfer).
    max_local_prefill_length: int = 0
    #: The request carries images: an encode worker is picked too, when encode pools exist.
    has_images: bool = False
    #: Workers picked first when they are candidates (healthy, in an eligible pool, not
    #: excluded), whatever the policy says: e.g. where another choice of the same prompt is
    #: cached. The others keep the policy's order behind them.
    prefer_ids: Sequence[str] = ()
    #: A video generation: picked from video pools only (no tokens, no KV).
    video: bool = False
    #: An embedding request: picked from embedding pools only (no KV to match).
    embedding: bool = False

    @property
    def whole_request_kind(self) -> str | None:
        """The pool kind (WHOLE_REQUEST_KINDS) this request goes to alone; None: a text
        generation."""
        return "video" if self.video else "embedding" if self.embedding else None


class Router:
    def __init__(self, pools: Sequence[PoolConfig], grid: GridConfig | None, block_size: int,
                 typical_osl: int, index: PrefixIndex | None = None) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.block_size = block_size
        self.typical_osl = typical_osl
        self.grid = grid
        self.pools: list[Pool] = []
        for i, cfg in enumerate(pools):
            if cfg.kind not in POOL_KINDS:
                raise InvalidRequest(f"pools[{i}].kind must be one of {', '.join(POOL_KINDS)}, "
                                     f"got '{cfg.kind}'", param=f"pools[{i}].kind")
            if cfg.kind in ("encode", *WHOLE_REQUEST_KINDS) and cfg.policy == "kv":
                # Encode, video and embedding workers hold no KV: there is no prefix to match.
                raise InvalidRequest(f"pools[{i}] is an {cfg.kind} pool; its policy cannot be "
                                     "'kv'", param=f"pools[{i}].policy")
            options: dict[str, object] = {}
            if cfg.policy == "kv":
                options = {"index": self.index, "prefill_load_scale": cfg.prefill_load_scale,
                           "temperature": cfg.temperature, "host_hit_cost": cfg.host_hit_cost}
            pool = Pool(cfg, create_policy(cfg.policy, **options))
            for address in cfg.workers:
                pool.workers[address] = WorkerState(WorkerRef(address, address, cfg.name),
                                                    block_size=block_size)
            self.pools.append(pool)
        #: request id -> what each worker it went to was handed.
        self._handed: dict[str, list[Handout]] = {}
        self._by_kind = {kind: [p for p in self.pools if p.config.kind == kind]
                         for kind in POOL_KINDS}
        if grid is not None:
            self._check_grid(grid)

    def _check_grid(self, grid: GridConfig) -> None:
        sets = ({"agg": grid.agg} if grid.mode == "agg"
                else {"prefill": grid.prefill, "decode": grid.decode})
        for kind, pool_set in sets.items():
            have = [p.name for p in self._by_kind[kind]]
            if pool_set is not None and pool_set.num_pools != len(have):
                raise InvalidRequest(f"the grid config has {pool_set.num_pools} {kind} pools but "
                                     f"the router config lists {len(have)}", param="pools")
            # The grid maps pool indices; when it also names them, the names must agree with
            # the router's order, or requests would silently land in the wrong pool.
            if pool_set is not None and pool_set.names and list(pool_set.names) != have:
                raise InvalidRequest(f"the grid names its {kind} pools {list(pool_set.names)} "
                                     f"but the router lists {have} (same names, same order)",
                                     param="pools")

    def can_serve(self) -> bool:
        """Whether some request could be routed now: a healthy decode, aggregated, video or
        embedding worker (prefill and encode workers alone serve nothing)."""
        return any(w.healthy for kind in ("decode", "agg", *WHOLE_REQUEST_KINDS)
                   for pool in self._by_kind[kind] for w in list(pool.workers.values()))

    def all_workers(self) -> list[WorkerState]:
        # list() of dict values is atomic under the GIL: the metrics thread may call this.
        return [w for pool in list(self.pools) for w in list(pool.workers.values())]

    def routes_by_prefix(self, pool_name: str) -> bool:
        """Whether the pool's policy reads the prefix index (kv)."""
        return any(p.config.policy == "kv" for p in self.pools if p.name == pool_name)

    def pool_members(self, pool_name: str) -> list[str]:
        """The addresses of a pool's workers."""
        return [w.ref.address for p in self.pools if p.name == pool_name
                for w in p.workers.values()]

    def set_pool_workers(self, pool_name: str, addresses: Sequence[str]) -> list[WorkerState]:
        """Membership change (DNS): returns the workers added; removed ones leave the index."""
        pool = next(p for p in self.pools if p.name == pool_name)
        added = []
        for address in addresses:
            if address not in pool.workers:
                pool.workers[address] = WorkerState(WorkerRef(address, address, pool_name),
                                                    block_size=self.block_size)
                added.append(pool.workers[address])
        for address in [a for a in pool.workers if a not in set(addresses)]:
            del pool.workers[address]
            self.index.remove_worker(address)
        return added

    def _pool_order(self, info: RouteRequestInfo) -> list[Pool]:
        sla = info.sla
        if self.grid is None:
            serving = self._by_kind["decode"] or self._by_kind["agg"]
            return list(serving)
        if self.grid.mode == "agg":
            choice = self.grid.select_agg_pool(sla.ttft_ms, sla.itl_ms, sla.priority,
                                               isl=info.isl)
            return [self._by_kind["agg"][i] for i in choice.pools]
        context = self.grid.decode_context_length(info.isl, min(info.expected_osl,
                                                                self.typical_osl))
        choice = self.grid.select_decode_pool(context, sla.itl_ms, sla.priority)
        return [self._by_kind["decode"][i] for i in choice.pools]

    def _prefill_pool_order(self, info: RouteRequestInfo) -> list[Pool]:
        pools = self._by_kind["prefill"]
        if self.grid is None or self.grid.mode != "disagg" or not pools:
            return list(pools)
        choice = self.grid.select_prefill_pool(info.isl, info.sla.ttft_ms, info.sla.priority)
        return [pools[i] for i in choice.pools]

    @staticmethod
    def _rank(pools: Sequence[Pool], ctx: RouteContext, exclude: set[str],
              prefer: Sequence[str] = ()) -> list[tuple[WorkerState, int]]:
        ordered: list[tuple[WorkerState, int]] = []
        preferred: list[tuple[WorkerState, int]] = []
        for pool in pools:
            candidates = [w for w in pool.workers.values()
                          if w.healthy and w.worker_id not in exclude]
            ranked = pool.policy.rank(candidates, ctx)
            if prefer:
                preferred += [pick for pick in ranked if pick[0].worker_id in prefer]
            # The first pool that can serve gives the pick and its own fallbacks; each later
            # pool in the retry order contributes its best worker.
            ordered.extend(ranked if not ordered else ranked[:1])
        if preferred:
            ids = {w.worker_id for w, _ in preferred}
            ordered = preferred + [pick for pick in ordered if pick[0].worker_id not in ids]
        return ordered

    def route(self, info: RouteRequestInfo) -> RouteDecision:
        """Picks the decode (or aggregated) worker and, when prefill pools exist and the prompt's
        part not cached on that worker is longer than `max_local_prefill_length`, a prefill
        worker. Without a healthy prefill worker the request is served aggregated. A request
        with images also gets encode workers, when encode pools have healthy ones (without, the
        prefill or decode worker encodes them itself). A video or embedding request gets
        workers of that kind only."""
        kind = info.whole_request_kind
        if kind is not None:
            return self._route_whole(kind, info)
        hashes = tuple(info.block_hashes) or tuple(hash_blocks(list(info.token_ids),
                                                               self.block_size))
        ctx = RouteContext(info.request_id, hashes, info.isl, info.expected_osl, info.sla)
        exclude = set(info.exclude_ids)
        ordered = self._rank(self._pool_order(info), ctx, exclude, info.prefer_ids)
        if not ordered:
            raise Unavailable("no healthy worker in any eligible pool"
                              + (f" (excluded: {', '.join(sorted(exclude))})" if exclude else ""))
        pick, overlap = ordered[0]
        new_blocks = max(len(hashes), math.ceil(info.isl / self.block_size))
        prefill_ordered: list[tuple[WorkerState, int]] = []
        if info.isl - overlap * self.block_size > info.max_local_prefill_length:
            prefill_ordered = self._rank(self._prefill_pool_order(info), ctx, exclude,
                                         info.prefer_ids)
        encode_ordered: list[tuple[WorkerState, int]] = []
        if info.has_images:
            encode_ordered = self._rank(self._by_kind["encode"], ctx, exclude)
        self._release(info.request_id)  # a re-routed request is counted once
        # An encode worker carries the request (no KV blocks) until it completes.
        handed = [self._hand_out(encode_ordered[0][0], 0, 0)] if encode_ordered else []
        if prefill_ordered:
            prefill_pick, overlap = prefill_ordered[0]
            handed += [self._hand_out(prefill_pick, max(new_blocks - overlap, 0), 0),
                       self._hand_out(pick, 0, new_blocks)]
        else:
            handed.append(self._hand_out(pick, max(new_blocks - overlap, 0), new_blocks))
        self._handed[info.request_id] = handed
        return RouteDecision(decode_workers=tuple(w.ref for w, _ in ordered),
                             prefill_workers=tuple(w.ref for w, _ in prefill_ordered),
                             encode_workers=tuple(w.ref for w, _ in encode_ordered),
                             disaggregate=bool(prefill_ordered), overlap_blocks=overlap)

    def _route_whole(self, kind: str, info: RouteRequestInfo) -> RouteDecision:
        """The `kind` pools' candidates in policy order (least loaded: the shortest queue); the
        pick carries the request until it completes."""
        ctx = RouteContext(info.request_id, (), 0, 0, info.sla)
        ordered = self._rank(self._by_kind[kind], ctx, set(info.exclude_ids))
        if not ordered:
            raise Unavailable(f"no healthy {kind} worker")
        self._release(info.request_id)
        self._handed[info.request_id] = [self._hand_out(ordered[0][0], 0, 0)]
        refs = tuple(w.ref for w, _ in ordered)
        if kind == "video":
            return RouteDecision(decode_workers=(), video_workers=refs)
        return RouteDecision(decode_workers=(), embedding_workers=refs)

    @staticmethod
    def _hand_out(worker: WorkerState, prefill_blocks: int, decode_blocks: int) -> Handout:
        worker.hand_out(prefill_blocks, decode_blocks)
        return Handout(worker, prefill_blocks, decode_blocks, worker.num_reports)

    def complete(self, request_id: str) -> bool:
        """Releases a routed request's load; False for an unknown (or already completed) id."""
        return self._release(request_id)

    def _release(self, request_id: str) -> bool:
        handed = self._handed.pop(request_id, None)
        if handed is None:
            return False
        for h in handed:
            h.worker.take_back(h.prefill_blocks, h.decode_blocks, h.reports_then)
        return True

    def in_flight(self, worker_id: str) -> int:
        """Requests routed to `worker_id` and not completed yet."""
        return sum(1 for handed in self._handed.values()
                   if any(h.worker.worker_id == worker_id for h in handed))

    def snapshot(self, now: float) -> list[PoolSnapshot]:
        """Every pool and worker as of `now` (time.monotonic()): candidacy, load, index."""
        in_flight = Counter(worker_id for handed in self._handed.values()
                            for worker_id in {h.worker.worker_id for h in handed})
        return [PoolSnapshot(pool.name, pool.config.kind, pool.config.policy, tuple(
            WorkerSnapshot.of(w, in_flight[w.worker_id], self.index.num_blocks_of(w.worker_id),
                              now)
            for w in list(pool.workers.values())), pool.config.prefill_load_scale,
            pool.config.temperature, pool.config.host_hit_cost)
            for pool in self.pools]
