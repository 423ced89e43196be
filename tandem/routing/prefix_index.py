"""Which workers hold which KV blocks, fed by the workers' KV event streams.

A positional map over chained block hashes: a block's hash covers its parent's hash (see
tandem.kv.hashing), so one hash names one whole prefix and a flat map hash -> holders answers
"who can reuse the first i blocks of this prompt" without a tree. Holders are an int bitset (one
bit per worker slot) rather than a set of ids: intersecting them is a single C-level AND, a new
block costs one small int instead of a set, and a million entries give the cycle collector
nothing to traverse.

Each KV tier has its own map (a worker with a host tier holds blocks in its device pool, in host
memory, or both), and a match mirrors the engine's: a run of device blocks from the prompt's
start, then a run of host blocks continuing it (which the engine copies back, not recomputes).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvTier


class TierOverlap(NamedTuple):
    """A worker's leading-block match: `device` blocks from the start, then `host` blocks."""

    device: int
    host: int

    @property
    def total(self) -> int:
        return self.device + self.host


class PrefixIndex:
    """The blocks each worker holds, and per request how long a prefix each can reuse.

    Contract:
      - `apply` follows a worker's event stream in order; `reset` replaces a worker's whole
        content with a resync snapshot; `remove_worker` forgets it (it left, or restarted with
        an empty cache). A worker is known from its first event or reset.
      - Events are idempotent per block and tier: storing a block a worker already holds in
        that tier, or removing one it does not hold there, changes nothing. AllBlocksCleared
        empties every tier.
      - BlockStored's parent_hash is not needed: each hash already covers its parent. A worker
        may hold a block without its parent (engines evict in their own order); `overlaps`
        counts only an unbroken run from the prompt's first block.
      - Not thread-safe: call from one thread (the router's event loop).

    Costs: `apply` is O(blocks in the events); `overlaps` is O(matched blocks + workers that
    match at least one block), independent of the index size; `remove_worker` and a cleared
    worker are O(that worker's blocks).
    """

    def __init__(self) -> None:
        #: Per tier: block hash -> bitset of the slots of the workers holding it (never 0:
        #: emptied keys go).
        self._tier_holders: dict[KvTier, dict[int, int]] = {t: {} for t in KvTier}
        #: Per tier: worker id -> the block hashes it holds (the inverse map, for removal).
        self._tier_blocks: dict[KvTier, dict[str, set[int]]] = {t: {} for t in KvTier}
        self._holders = self._tier_holders[KvTier.DEVICE]
        self._blocks = self._tier_blocks[KvTier.DEVICE]
        #: worker id -> its bit position; positions are reused after remove_worker.
        self._slot: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._free: list[int] = []

    # -- feeding -----------------------------------------------------------------------------

    def apply(self, worker_id: str, events: Sequence[KvEvent]) -> None:
        """Applies one batch of `worker_id`'s events, in order.

        Raises:
            TypeError: an element is not a KV event (nothing after it is applied).
        """
        bit = 1 << self._slot_of(worker_id)
        for event in events:
            if isinstance(event, BlockStored):
                holders = self._tier_holders[event.tier]
                get = holders.get
                for h in event.block_hashes:
                    holders[h] = get(h, 0) | bit
                self._tier_blocks[event.tier][worker_id].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                holders = self._tier_holders[event.tier]
                blocks = self._tier_blocks[event.tier][worker_id]
                keep = ~bit
                for h in event.block_hashes:
                    if h in blocks:
                        blocks.remove(h)
                        mask = holders[h] & keep
                        if mask:
                            holders[h] = mask
                        else:
                            del holders[h]
            elif isinstance(event, AllBlocksCleared):
                self._drop_blocks(worker_id, bit)
            else:
                raise TypeError(f"not a KV event: {event!r}")

    def reset(self, worker_id: str, blocks: Sequence[BlockStored]) -> None:
        """Replaces everything known of `worker_id` with a resync snapshot of its cache."""
        bit = 1 << self._slot_of(worker_id)
        self._drop_blocks(worker_id, bit)
        self.apply(worker_id, blocks)

    def remove_worker(self, worker_id: str) -> None:
        """Forgets `worker_id` and its blocks; a no-op for an unknown worker."""
        slot = self._slot.pop(worker_id, None)
        if slot is None:
            return
        self._drop_blocks(worker_id, 1 << slot)
        for by_worker in self._tier_blocks.values():
            del by_worker[worker_id]
        self._ids[slot] = None
        self._free.append(slot)

    # -- queries -----------------------------------------------------------------------------

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many LEADING blocks of `block_hashes` it holds (a device run, then
        a host run; see `overlaps_by_tier`).

        `block_hashes` are a prompt's chained hashes in order. A worker's count stops at its
        first missing block, even if it holds later ones. Workers matching no block are absent
        (read a missing key as 0).
        """
        if self._tier_holders[KvTier.HOST]:
            return {w: o.total for w, o in self.overlaps_by_tier(block_hashes).items()}
        result: dict[str, int] = {}
        if not block_hashes:
            return result
        holders = self._holders
        active = holders.get(block_hashes[0], 0)
        depth = 1
        if active:
            for i in range(1, len(block_hashes)):
                kept = active & holders.get(block_hashes[i], 0)
                if kept != active:
                    self._record(active ^ kept, depth, result)
                    active = kept
                    if not active:
                        break
                depth += 1
            self._record(active, depth, result)
        return result

    def overlaps_by_tier(self, block_hashes: Sequence[int]) -> dict[str, TierOverlap]:
        """Per worker, its leading match as the engine takes it: blocks held in the device tier
        from the start, then blocks held in the host tier from the first device miss on (a
        block missing from the host tier ends it, even if the device tier holds it). Workers
        matching no block are absent."""
        result: dict[str, TierOverlap] = {}
        if not block_hashes:
            return result
        dev_get = self._tier_holders[KvTier.DEVICE].get
        host_get = self._tier_holders[KvTier.HOST].get
        dev_active = dev_get(block_hashes[0], 0)
        host_active = host_get(block_hashes[0], 0) & ~dev_active
        device_depth: dict[int, int] = {}  # bit -> device blocks, once it left the device run
        if host_active:
            self._mark(host_active, 0, device_depth)
        depth = 1
        for i in range(1, len(block_hashes)):
            if not (dev_active or host_active):
                break
            h = block_hashes[i]
            in_dev = dev_get(h, 0)
            in_host = host_get(h, 0)
            moved = dev_active & ~in_dev
            if moved:
                self._mark(moved, depth, device_depth)
            candidates = host_active | moved
            ended = candidates & ~in_host
            if ended:
                self._record_tiers(ended, depth, device_depth, result)
            dev_active &= in_dev
            host_active = candidates & in_host
            depth += 1
        self._record_tiers(dev_active | host_active, depth, device_depth, result)
        return result

    @staticmethod
    def _mark(bits: int, depth: int, device_depth: dict[int, int]) -> None:
        while bits:
            low = bits & -bits
            device_depth[low] = depth
            bits ^= low

    def _record_tiers(self, bits: int, depth: int, device_depth: dict[int, int],
                      result: dict[str, TierOverlap]) -> None:
        ids = self._ids
        while bits:
            low = bits & -bits
            worker_id = ids[low.bit_length() - 1]
            device = device_depth.get(low, depth)
            if worker_id is not None and depth:
                result[worker_id] = TierOverlap(device, depth - device)
            bits ^= low

    def num_blocks_of(self, worker_id: str) -> int:
        """(block, tier) entries `worker_id` holds: a block in both tiers counts twice."""
        return sum(len(by_worker.get(worker_id, ())) for by_worker in self._tier_blocks.values())

    def blocks_of(self, worker_id: str, tier: KvTier = KvTier.DEVICE) -> set[int]:
        """A copy of the block hashes `worker_id` holds in `tier` (empty for an unknown
        worker)."""
        return set(self._tier_blocks[tier].get(worker_id, ()))

    @property
    def worker_ids(self) -> list[str]:
        """Every worker the index knows, including those holding no block."""
        return list(self._slot)

    @property
    def num_blocks(self) -> int:
        """Indexed (worker, block, tier) entries: a block two workers hold counts twice."""
        return sum(len(blocks) for by_worker in self._tier_blocks.values()
                   for blocks in by_worker.values())

    @property
    def num_unique_blocks(self) -> int:
        """Distinct block hashes held by at least one worker, in any tier."""
        return len(self._holders.keys() | self._tier_holders[KvTier.HOST].keys())

    # -- internals ---------------------------------------------------------------------------

    def _slot_of(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._ids[slot] = worker_id
            else:
                slot = len(self._ids)
                self._ids.append(worker_id)
            self._slot[worker_id] = slot
            for by_worker in self._tier_blocks.values():
                by_worker[worker_id] = set()
        return slot

    def _drop_blocks(self, worker_id: str, bit: int) -> None:
        keep = ~bit
        for tier, holders in self._tier_holders.items():
            blocks = self._tier_blocks[tier][worker_id]
            for h in blocks:
                mask = holders[h] & keep
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]
            blocks.clear()

    def _record(self, bits: int, depth: int, result: dict[str, int]) -> None:
        ids = self._ids
        while bits:
            low = bits & -bits
            worker_id = ids[low.bit_length() - 1]
            if worker_id is not None:
                result[worker_id] = depth
            bits ^= low
