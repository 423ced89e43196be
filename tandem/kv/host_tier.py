"""The second KV tier: host-memory slots keyed by the same chained block hashes as the device
pool, filled with the blocks the device pool evicts and read back on a prefix hit.

This is bookkeeping only (which hash lives in which slot, LRU order, pins, events); the bytes
live in the engine (the reference engine's host tensor, nothing for the mock) and move through
the copies the device pool queues (`BlockCopies`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.engines.types import BlockRemoved, BlockStored, KvEvent, KvTier


@dataclass(slots=True)
class BlockCopies:
    """The copies one engine step must run before its forward pass, in this order: every
    offload (it reads a device block that this step may already reuse), then every onboard (it
    may write a device block an offload of the same step reads first)."""

    #: (device block, host slot): an evicted device block's KV goes to the host tier.
    offloads: list[tuple[int, int]] = field(default_factory=list)
    #: (host slot, device block): a host-tier prefix hit comes back into a new device block.
    onboards: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.onboards)


class HostTier:
    """Fixed slots of host memory, each holding one block's KV, by chained block hash.

    Contract:
      - `store` files an evicted device block under its hash (its metadata is the host-tier
        BlockStored event); a hash already held is only touched. A full tier drops its least
        recently used unpinned block (BlockRemoved, tier HOST); with every slot pinned the new
        block is dropped instead (`num_dropped`): nothing ever waits for room.
      - `pin` keeps a slot from being reused while an onboard copy from it is pending; the
        engine unpins once the step's copies are issued (copies run in order, so a later
        offload into the slot cannot overtake the read).
      - `forget` drops a slot whose bytes are suspect (a failed copy).
      - Events go to the list shared with the device pool, so both tiers' events keep one order.
      - Not thread-safe; the engine loop owns it.
    """

    def __init__(self, num_slots: int, block_size: int, events: list[KvEvent]) -> None:
        if num_slots <= 0:
            raise ValueError(f"need num_slots > 0, got {num_slots}")
        self.total = num_slots
        self.block_size = block_size
        self._events = events
        #: slot -> the single-block BlockStored (tier HOST) it holds, None when empty.
        self._meta: list[BlockStored | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}
        self._pins = [0] * num_slots
        self._empty: list[int] = list(range(num_slots - 1, -1, -1))
        #: Hashed, unpinned slots, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.num_stored = 0
        self.num_evicted = 0
        self.num_dropped = 0

    @property
    def num_used(self) -> int:
        """Slots holding a block or pinned by a pending copy."""
        return self.total - len(self._empty)

    @property
    def num_cached(self) -> int:
        return len(self._slot_of)

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding `block_hash`, or None."""
        return self._slot_of.get(block_hash)

    def hashes(self) -> set[int]:
        """Every block hash the tier holds (tests, resync checks)."""
        return set(self._slot_of)

    def store(self, block: BlockStored) -> int | None:
        """Files a single-block `block` (tier HOST); returns the slot its KV must be copied to,
        or None when no copy is needed (already held: touched) or possible (every slot pinned)."""
        h = block.block_hashes[0]
        held = self._slot_of.get(h)
        if held is not None:
            if held in self._lru:
                self._lru.move_to_end(held)
            return None
        if self._empty:
            slot = self._empty.pop()
        elif self._lru:
            slot, _unused = self._lru.popitem(last=False)
            old = self._meta[slot]
            assert old is not None
            del self._slot_of[old.block_hashes[0]]
            self._events.append(BlockRemoved((old.block_hashes[0],), KvTier.HOST))
            self.num_evicted += 1
        else:
            self.num_dropped += 1
            return None
        self._meta[slot] = block
        self._slot_of[h] = slot
        self._lru[slot] = None
        self._events.append(block)
        self.num_stored += 1
        return slot

    def pin(self, slot: int) -> None:
        if self._pins[slot] == 0:
            self._lru.pop(slot, None)
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """Ends one pin; a slot that was read is the most recently used."""
        pins = self._pins[slot] - 1
        if pins < 0:
            raise AssertionError(f"host slot {slot} unpinned more often than pinned")
        self._pins[slot] = pins
        if pins == 0:
            if self._meta[slot] is None:
                self._empty.append(slot)
            else:
                self._lru[slot] = None

    def forget(self, slot: int) -> None:
        """Drops what `slot` holds (its bytes cannot be trusted) with a BlockRemoved."""
        block = self._meta[slot]
        if block is None:
            return
        self._meta[slot] = None
        del self._slot_of[block.block_hashes[0]]
        self._events.append(BlockRemoved((block.block_hashes[0],), KvTier.HOST))
        if self._pins[slot] == 0:
            del self._lru[slot]
            self._empty.append(slot)

    def clear(self) -> None:
        """Forgets every block without events (the pool publishes AllBlocksCleared)."""
        for slot in list(self._slot_of.values()):
            self._meta[slot] = None
            if self._pins[slot] == 0:
                self._empty.append(slot)
        self._slot_of.clear()
        self._lru.clear()

    def snapshot(self) -> list[BlockStored]:
        """The blocks held, as their host-tier BlockStored events."""
        return [b for b in self._meta if b is not None]

    def check_invariants(self, pinned: Iterable[int] | None = None) -> None:
        """Raises AssertionError unless the tier is consistent; with `pinned` (every pending
        onboard's slot, repeated per pin) pins must match it exactly. O(tier): tests only."""
        empty = set(self._empty)
        assert len(empty) == len(self._empty), "a host slot is on the empty list twice"
        for slot in range(self.total):
            block = self._meta[slot]
            pins = self._pins[slot]
            assert pins >= 0
            if slot in empty:
                assert block is None and pins == 0, f"empty host slot {slot} in use"
            elif block is None:
                assert pins > 0, f"host slot {slot} neither empty nor holding a block"
            else:
                assert self._slot_of.get(block.block_hashes[0]) == slot, \
                    f"host slot {slot} hash not indexed"
                assert (slot in self._lru) == (pins == 0), f"host slot {slot} LRU vs pins"
        assert len(self._slot_of) == sum(b is not None for b in self._meta)
        if pinned is None:
            return
        expected = [0] * self.total
        for slot in pinned:
            expected[slot] += 1
        assert expected == self._pins, "host pins differ from the pending onboards"
