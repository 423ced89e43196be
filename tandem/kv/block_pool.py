"""A paged KV block pool with reference counts, prefix caching over chained hashes, LRU eviction
of idle cached blocks, an optional host tier behind it (tandem.kv.host_tier), and the KV events
those changes produce."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvTier
from tandem.kv.host_tier import BlockCopies, HostTier


class BlockTable:
    """The blocks one sequence holds, in token order. Owned by the sequence, mutated only by the
    pool. `num_committed` leading blocks are full and have been offered to the prefix cache."""

    __slots__ = ("block_ids", "num_committed")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.num_committed = 0

    def __len__(self) -> int:
        return len(self.block_ids)


class PrefixMatch(NamedTuple):
    """Leading blocks of a sequence already in the cache (from `BlockPool.match_prefix`): a run
    of device blocks, then a run of host-tier slots continuing it."""

    block_ids: tuple[int, ...]
    #: Tokens of the sequence the lookup covered (for hit-rate accounting).
    num_query_tokens: int
    #: Host-tier slots of the blocks right after `block_ids`, in order (copied back on allocate).
    host_slots: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.host_slots)


_NO_MATCH = PrefixMatch((), 0)


class BlockPool:
    """Fixed-size pool of KV blocks shared by every sequence of one engine.

    Contract:
      - The caller decides, the pool mutates: `can_allocate`/`allocate` give an empty table its
        first blocks (reusing a prefix match), `can_append`/`append` grow a table, `commit`
        offers full blocks to the prefix cache, `free` returns a table's blocks.
      - A block is either held (ref count > 0, by one or more tables) or free; a free block is
        either empty or cached (it still holds a registered hash and can be matched again).
        Allocation takes empty blocks first, then evicts cached ones least recently freed first.
      - Every hash enters the cache once (`BlockStored`) and leaves once (`BlockRemoved` on
        eviction, `AllBlocksCleared` on `clear`); a block whose hash is already cached in another
        block is a private duplicate and publishes nothing. Events queue until `take_events`.
      - With a host tier (`num_host_blocks` > 0): an evicted cached block is filed there and
        its copy queued (offload); a lookup continues past the device run into the host tier,
        and `allocate` gives the host-matched positions new blocks and queues their copies back
        (onboard), pinning the host slots. The engine runs `take_copies()` before the step's
        forward pass and unpins the onboards' slots once issued.
      - Not thread-safe; one engine loop owns it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, "
                             f"{block_size}")
        self.block_size = block_size
        self.total = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # Empty blocks as a stack (reverse so block 0 goes first); cached idle blocks as an LRU
        # (oldest first), an OrderedDict so that removing a re-matched block is O(1).
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._events: list[KvEvent] = []
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        #: The host tier, None without one; its events share this pool's list (one order).
        self.host = HostTier(num_host_blocks, block_size, self._events) if num_host_blocks else None
        #: With a host tier: each hashed block's host-tier BlockStored, kept from its commit so
        #: that an eviction can file it there.
        self._meta: list[BlockStored | None] = [None] * num_blocks if self.host else []
        self._copies = BlockCopies()
        self.num_host_hit_tokens = 0

    # ---- counters -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.total - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose hash is registered (held or idle)."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        return self.num_used / self.total

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache (either tier), 0.0 before any
        lookup."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the host tier."""
        return self.num_host_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup and allocation -----------------------------------------------------

    def match_prefix(self, hashes: Sequence[int], num_query_tokens: int, max_blocks: int
                     ) -> PrefixMatch:
        """The longest cached run of `hashes[:max_blocks]` from the start: device blocks, then
        (with a host tier) host slots from the first device miss on. Changes nothing."""
        if not self.enable_prefix_caching:
            return PrefixMatch((), num_query_tokens)
        found: list[int] = []
        lookup = self._hash_to_block
        wanted = hashes[:max_blocks]
        for h in wanted:
            block = lookup.get(h)
            if block is None:
                break
            found.append(block)
        slots: list[int] = []
        if self.host is not None:
            host_lookup = self.host.lookup
            for h in wanted[len(found):]:
                slot = host_lookup(h)
                if slot is None:
                    break
                slots.append(slot)
        return PrefixMatch(tuple(found), num_query_tokens, tuple(slots))

    def _cost(self, match: PrefixMatch, num_blocks: int) -> int:
        # Free blocks consumed: new ones, plus matched idle blocks leaving the free lists.
        ref = self._ref
        reused_idle = sum(1 for b in match.block_ids if ref[b] == 0)
        return max(num_blocks - len(match.block_ids), 0) + reused_idle

    def can_allocate(self, num_tokens: int, match: PrefixMatch = _NO_MATCH) -> bool:
        """Whether an empty table can get blocks for `num_tokens` tokens, reusing `match`."""
        return self._cost(match, self.blocks_for(num_tokens)) <= self.num_free

    def allocate(self, table: BlockTable, num_tokens: int, match: PrefixMatch = _NO_MATCH
                 ) -> None:
        """Gives an empty `table` the matched blocks, then new ones up to `num_tokens` tokens;
        the first new ones receive the match's host-tier blocks (queued onboard copies)."""
        if table.block_ids:
            raise ValueError("allocate needs an empty table; use append to grow one")
        num_blocks = self.blocks_for(num_tokens)
        if match.num_blocks > num_blocks:
            raise ValueError("prefix match longer than the allocation")
        if not self.can_allocate(num_tokens, match):
            raise MemoryError(f"KV pool exhausted: {num_blocks} blocks wanted, "
                              f"{self.num_free} free")
        ref, cached_free = self._ref, self._cached_free
        for b in match.block_ids:
            if self._hash[b] is None:
                raise ValueError(f"matched block {b} is no longer cached")
            if ref[b] == 0:
                del cached_free[b]
            ref[b] += 1
        table.block_ids.extend(match.block_ids)
        table.num_committed = len(match.block_ids)
        self.num_query_tokens += match.num_query_tokens
        self.num_hit_tokens += match.num_blocks * self.block_size
        if match.host_slots:
            assert self.host is not None
            # Pinned before _take: its evictions may file blocks in the host tier, and must not
            # reuse the slots about to be read.
            for slot in match.host_slots:
                self.host.pin(slot)
            self.num_host_hit_tokens += len(match.host_slots) * self.block_size
        first_new = len(table.block_ids)
        self._take(table, num_blocks - len(match.block_ids))
        onboards = self._copies.onboards
        for i, slot in enumerate(match.host_slots):
            onboards.append((slot, table.block_ids[first_new + i]))

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether `table` can grow to cover `num_tokens` tokens."""
        return self.blocks_for(num_tokens) - len(table.block_ids) <= self.num_free

    def append(self, table: BlockTable, num_tokens: int) -> None:
        """Grows `table` to cover `num_tokens` tokens (no-op when it already does)."""
        missing = self.blocks_for(num_tokens) - len(table.block_ids)
        if missing > self.num_free:
            raise MemoryError(f"KV pool exhausted: {missing} blocks wanted, "
                              f"{self.num_free} free")
        if missing > 0:
            self._take(table, missing)

    def _take(self, table: BlockTable, count: int) -> None:
        empty, cached_free, ref = self._empty, self._cached_free, self._ref
        evicted: list[int] = []
        for _ in range(count):
            if empty:
                b = empty.pop()
            else:
                b, _unused = cached_free.popitem(last=False)
                h = self._hash[b]
                assert h is not None
                del self._hash_to_block[h]
                self._hash[b] = None
                evicted.append(h)
                if self.host is not None:
                    self._offload(b)
            ref[b] = 1
            table.block_ids.append(b)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))

    def _offload(self, block: int) -> None:
        """Files an evicted block in the host tier and queues its copy there."""
        assert self.host is not None
        meta = self._meta[block]
        self._meta[block] = None
        if meta is None:
            return
        slot = self.host.store(meta)
        if slot is not None:
            self._copies.offloads.append((block, slot))

    @property
    def has_copies(self) -> bool:
        """Whether copies are queued for the next step (see take_copies)."""
        return bool(self._copies)

    def take_copies(self) -> BlockCopies:
        """The copies queued since the previous call (offloads, then onboards); the caller runs
        them before the next forward pass and unpins each onboard's host slot."""
        copies, self._copies = self._copies, BlockCopies()
        return copies

    def forget_blocks(self, block_ids: Sequence[int]) -> None:
        """Unregisters the hashes of `block_ids` (their KV cannot be trusted: a failed onboard)
        with a BlockRemoved; the blocks stay held by whoever holds them."""
        removed = []
        for b in block_ids:
            h = self._hash[b]
            if h is None:
                continue
            del self._hash_to_block[h]
            self._hash[b] = None
            if self._meta:
                self._meta[b] = None
            removed.append(h)
            if self._ref[b] == 0:
                del self._cached_free[b]
                self._empty.append(b)
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))

    # ---- caching, release ------------------------------------------------------------------

    def commit(self, table: BlockTable, token_ids: Sequence[int], hashes: Sequence[int],
               num_full_blocks: int,
               mm_hashes_per_block: Sequence[Sequence[str]] | None = None) -> None:
        """Offers `table`'s blocks up to `num_full_blocks` (all full, their KV computed or being
        computed this step) to the prefix cache; `hashes[i]` is block i's chained hash.

        Adjacent newly cached blocks become one BlockStored event.
        """
        start = table.num_committed
        if num_full_blocks <= start:
            return
        if num_full_blocks > len(table.block_ids) or num_full_blocks > len(hashes):
            raise ValueError("commit past the table's blocks or the known hashes")
        table.num_committed = num_full_blocks
        if not self.enable_prefix_caching:
            return
        run_start = -1
        lookup, block_hash, meta = self._hash_to_block, self._hash, self._meta
        bs = self.block_size
        for i in range(start, num_full_blocks):
            h = hashes[i]
            b = table.block_ids[i]
            if h in lookup:  # same content already cached in another block: private duplicate
                if run_start >= 0:
                    self._stored(token_ids, hashes, run_start, i, mm_hashes_per_block)
                    run_start = -1
                continue
            lookup[h] = b
            block_hash[b] = h
            if meta:
                mm = (tuple(mm_hashes_per_block[i])
                      if mm_hashes_per_block and i < len(mm_hashes_per_block) else ())
                meta[b] = BlockStored((h,), hashes[i - 1] if i else None,
                                      tuple(token_ids[i * bs:(i + 1) * bs]), bs, mm, KvTier.HOST)
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._stored(token_ids, hashes, run_start, num_full_blocks, mm_hashes_per_block)

    def _stored(self, token_ids: Sequence[int], hashes: Sequence[int], lo: int, hi: int,
                mm_hashes_per_block: Sequence[Sequence[str]] | None) -> None:
        bs = self.block_size
        mm: tuple[str, ...] = ()
        if mm_hashes_per_block:
            mm = tuple(dict.fromkeys(
                h for i in range(lo, min(hi, len(mm_hashes_per_block)))
                for h in mm_hashes_per_block[i]))
        self._events.append(BlockStored(
            block_hashes=tuple(hashes[lo:hi]),
            parent_hash=hashes[lo - 1] if lo > 0 else None,
            token_ids=tuple(token_ids[lo * bs:hi * bs]),
            block_size=bs,
            mm_hashes=mm,
        ))

    def free(self, table: BlockTable) -> None:
        """Releases every block of `table` and empties it. Cached blocks stay matchable until
        evicted; the table's last blocks are queued for eviction first (they are the least
        likely to be shared)."""
        ref, block_hash, cached_free, empty = self._ref, self._hash, self._cached_free, self._empty
        for b in reversed(table.block_ids):
            ref[b] -= 1
            if ref[b] == 0:
                if block_hash[b] is None:
                    empty.append(b)
                else:
                    cached_free[b] = None
            elif ref[b] < 0:
                raise AssertionError(f"block {b} freed more often than allocated")
        table.block_ids.clear()
        table.num_committed = 0

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Releases the blocks of `table` past those that hold `num_tokens` tokens (speculative
        decoding: blocks taken for proposals that verification rejected). They were never
        committed, so they go back as empty blocks, unhashed."""
        keep = self.blocks_for(num_tokens)
        if keep < table.num_committed:
            raise AssertionError(f"truncating to {keep} blocks would drop committed ones "
                                 f"({table.num_committed})")
        ref, empty = self._ref, self._empty
        while len(table.block_ids) > keep:
            b = table.block_ids.pop()
            assert self._hash[b] is None, f"block {b} past the committed ones is hashed"
            ref[b] -= 1
            if ref[b] == 0:
                empty.append(b)

    def clear(self) -> None:
        """Forgets every cached hash in both tiers (held blocks stay held but become private)
        and publishes AllBlocksCleared."""
        for b in self._hash_to_block.values():
            self._hash[b] = None
            if self._meta:
                self._meta[b] = None
        self._hash_to_block.clear()
        self._empty.extend(self._cached_free)
        self._cached_free.clear()
        if self.host is not None:
            self.host.clear()
        self._events.append(AllBlocksCleared())

    def hashes(self) -> set[int]:
        """Every block hash the device pool holds (tests, resync checks)."""
        return set(self._hash_to_block)

    def take_events(self) -> list[KvEvent]:
        """The events since the previous call, oldest first."""
        # Emptied in place: the host tier appends to the same list.
        events = self._events[:]
        self._events.clear()
        return events

    # ---- checks (tests, debugging) --------------------------------------------------------

    def check_invariants(self, tables: Iterable[BlockTable] | None = None) -> None:
        """Raises AssertionError unless the pool is consistent (and, given every live table,
        each block's ref count equals the number of tables holding it). O(pool): tests only."""
        empty, cached = set(self._empty), set(self._cached_free)
        assert len(empty) == len(self._empty), "a block is on the empty list twice"
        assert not empty & cached, "a block is both empty and cached"
        assert self.num_free + self.num_used == self.total
        for b in range(self.total):
            is_free = b in empty or b in cached
            assert (self._ref[b] == 0) == is_free, f"block {b}: ref {self._ref[b]}, free {is_free}"
            assert self._ref[b] >= 0
            if b in empty:
                assert self._hash[b] is None, f"empty block {b} still hashed"
            if b in cached:
                assert self._hash[b] is not None, f"cached block {b} has no hash"
            h = self._hash[b]
            if h is not None:
                assert self._hash_to_block.get(h) == b, f"block {b} hash not indexed"
        assert len(self._hash_to_block) == sum(h is not None for h in self._hash)
        if self.host is not None:
            for b in range(self.total):
                assert (self._meta[b] is None) == (self._hash[b] is None), \
                    f"block {b}: host-tier metadata out of step with its hash"
            self.host.check_invariants([slot for slot, _ in self._copies.onboards])
        if tables is None:
            return
        counts = [0] * self.total
        for table in tables:
            assert len(set(table.block_ids)) == len(table.block_ids), "table holds a block twice"
            for b in table.block_ids:
                counts[b] += 1
        assert counts == self._ref, "ref counts differ from the tables holding blocks"
