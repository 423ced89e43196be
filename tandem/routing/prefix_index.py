"""Which workers hold which KV blocks, fed by the workers' KV event streams.

A positional map over chained block hashes: a block's hash covers its parent's hash (see
tandem.kv.hashing), so one hash names one whole prefix and a flat map hash -> holders answers
"who can reuse the first i blocks of this prompt" without a tree. Holders are an int bitset (one
bit per worker slot) rather than a set of ids: intersecting them is a single C-level AND, a new
block costs one small int instead of a set, and a million entries give the cycle collector
nothing to traverse.
"""
from __future__ import annotations

from collections.abc import Sequence

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class PrefixIndex:
    """The blocks each worker holds, and per request how long a prefix each can reuse.

    Contract:
      - `apply` follows a worker's event stream in order; `reset` replaces a worker's whole
        content with a resync snapshot; `remove_worker` forgets it (it left, or restarted with
        an empty cache). A worker is known from its first event or reset.
      - Events are idempotent per block: storing a block a worker already holds, or removing
        one it does not hold, changes nothing.
      - BlockStored's parent_hash is not needed: each hash already covers its parent. A worker
        may hold a block without its parent (engines evict in their own order); `overlaps`
        counts only an unbroken run from the prompt's first block.
      - Not thread-safe: call from one thread (the router's event loop).

    Costs: `apply` is O(blocks in the events); `overlaps` is O(matched blocks + workers that
    match at least one block), independent of the index size; `remove_worker` and a cleared
    worker are O(that worker's blocks).
    """

    def __init__(self) -> None:
        #: block hash -> bitset of the slots of the workers holding it (never 0: emptied keys go).
        self._holders: dict[int, int] = {}
        #: worker id -> the block hashes it holds (the inverse map, for removal and tests).
        self._blocks: dict[str, set[int]] = {}
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
        blocks = self._blocks[worker_id]
        holders = self._holders
        for event in events:
            if isinstance(event, BlockStored):
                get = holders.get
                for h in event.block_hashes:
                    holders[h] = get(h, 0) | bit
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
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
        del self._blocks[worker_id]
        self._ids[slot] = None
        self._free.append(slot)

    # -- queries -----------------------------------------------------------------------------

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many LEADING blocks of `block_hashes` it holds.

        `block_hashes` are a prompt's chained hashes in order. A worker's count stops at its
        first missing block, even if it holds later ones. Workers matching no block are absent
        (read a missing key as 0).
        """
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

    def num_blocks_of(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def blocks_of(self, worker_id: str) -> set[int]:
        """A copy of the block hashes `worker_id` holds (empty for an unknown worker)."""
        return set(self._blocks.get(worker_id, ()))

    @property
    def worker_ids(self) -> list[str]:
        """Every worker the index knows, including those holding no block."""
        return list(self._slot)

    @property
    def num_blocks(self) -> int:
        """Indexed (worker, block) pairs: a block two workers hold counts twice."""
        return sum(len(blocks) for blocks in self._blocks.values())

    @property
    def num_unique_blocks(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._holders)

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
            self._blocks[worker_id] = set()
        return slot

    def _drop_blocks(self, worker_id: str, bit: int) -> None:
        holders = self._holders
        keep = ~bit
        blocks = self._blocks[worker_id]
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
