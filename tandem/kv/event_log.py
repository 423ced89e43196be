"""The worker-side KV event log behind the KvEvents service: numbered batches for replay, and the
set of blocks currently stored for subscribers that must resync."""
from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import deque
from collections.abc import Sequence

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvTier


class EventLog:
    """A bounded, numbered log of KV event batches.

    Contract:
      - `append` gives each non-empty batch the next sequence number (1, 2, ...); it is usable
        directly as an engine's event sink. The newest `capacity` batches are kept for replay.
      - `since(n)` replays batches numbered >= n, or returns None when some of them were
        already dropped: the subscriber must then resync from `snapshot()`, which is consistent
        with exactly the returned sequence number.
      - The snapshot follows the events as they are appended (stored adds blocks, removed drops
        them, cleared drops all), each tier on its own (a hash may be stored in the device pool
        and the host tier at once), so it never needs the dropped batches.
      - Call every method from the event loop's thread (the engine's loop); `wait_beyond` wakes
        waiters without polling.
    """

    def __init__(self, capacity: int = 10000) -> None:
        #: Identifies this log's lifetime: sequence numbers restart with a new epoch (a restarted
        #: worker), so a subscriber's old sequence number means nothing under another epoch.
        self.epoch = secrets.randbits(63)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._batches: deque[tuple[int, tuple[KvEvent, ...]]] = deque(maxlen=capacity)
        self._last = 0
        # hash -> tier -> the block as a single-block BlockStored. Insertion order is not enough
        # for parents-before-children (a parent can be evicted and stored again after its
        # child); snapshot() orders them.
        self._stored: dict[int, dict[KvTier, BlockStored]] = {}
        self._changed = asyncio.Event()

    @property
    def last_sequence(self) -> int:
        """Sequence number of the newest batch; 0 before any."""
        return self._last

    @property
    def oldest_sequence(self) -> int:
        """Sequence number of the oldest retained batch; last_sequence + 1 when none is kept."""
        return self._batches[0][0] if self._batches else self._last + 1

    def append(self, events: Sequence[KvEvent]) -> int:
        """Records one batch and returns its sequence number (the current one if `events` is
        empty, which records nothing)."""
        if not events:
            return self._last
        batch = tuple(events)
        for event in batch:
            self._apply(event)
        self._last += 1
        self._batches.append((self._last, batch))
        # Wake current waiters, then arm a fresh event for the next ones.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return self._last

    def _apply(self, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            bs = event.block_size
            parent = event.parent_hash
            for i, h in enumerate(event.block_hashes):
                self._stored.setdefault(h, {})[event.tier] = BlockStored(
                    block_hashes=(h,), parent_hash=parent,
                    token_ids=event.token_ids[i * bs:(i + 1) * bs], block_size=bs,
                    mm_hashes=event.mm_hashes, tier=event.tier)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                tiers = self._stored.get(h)
                if tiers is not None:
                    tiers.pop(event.tier, None)
                    if not tiers:
                        del self._stored[h]
        elif isinstance(event, AllBlocksCleared):
            self._stored.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def since(self, start_sequence: int) -> list[tuple[int, tuple[KvEvent, ...]]] | None:
        """Batches numbered >= `start_sequence`, oldest first; [] when `start_sequence` is past
        the newest; None when batches in that range were dropped (resync needed)."""
        start = max(start_sequence, 1)
        if start > self._last:
            return []
        oldest = self.oldest_sequence
        if start < oldest:
            return None
        return list(itertools.islice(self._batches, start - oldest, None))

    def snapshot(self) -> tuple[int, list[BlockStored]]:
        """(the sequence number it reflects, every stored block as a single-block BlockStored
        per tier holding it, parents before children)."""
        stored = self._stored
        out: list[BlockStored] = []
        emitted: set[int] = set()
        for h, tiers in stored.items():
            if h in emitted:
                continue
            # Walk up to the first ancestor already emitted (or absent), then emit downwards.
            chain = [h]
            in_chain = {h}  # guards against a cycle from a malformed event
            parent = _parent(tiers)
            while (parent is not None and parent in stored and parent not in emitted
                   and parent not in in_chain):
                chain.append(parent)
                in_chain.add(parent)
                parent = _parent(stored[parent])
            for item in reversed(chain):
                emitted.add(item)
                out.extend(stored[item].values())
        return self._last, out

    async def wait_beyond(self, sequence: int) -> None:
        """Returns once `last_sequence > sequence`."""
        while self._last <= sequence:
            await self._changed.wait()


def _parent(tiers: dict[KvTier, BlockStored]) -> int | None:
    """A block's parent hash (the same in every tier: it is part of what the hash covers)."""
    return next(iter(tiers.values())).parent_hash
