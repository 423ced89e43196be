"""A paged KV block pool with reference counts, prefix caching over chained hashes, LRU eviction
of idle cached blocks, and the KV events those changes produce."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


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
    """Leading blocks of a sequence already in the cache (from `BlockPool.match_prefix`)."""

    block_ids: tuple[int, ...]
    #: Tokens of the sequence the lookup covered (for hit-rate accounting).
    num_query_tokens: int


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
      - Not thread-safe; one engine loop owns it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
                 ) -> None:
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
        """Share of looked-up prompt tokens served from the cache, 0.0 before any lookup."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup and allocation -----------------------------------------------------

    def match_prefix(self, hashes: Sequence[int], num_query_tokens: int, max_blocks: int
                     ) -> PrefixMatch:
        """The longest cached run of `hashes[:max_blocks]` from the start. Changes nothing."""
        if not self.enable_prefix_caching:
            return PrefixMatch((), num_query_tokens)
        found: list[int] = []
        lookup = self._hash_to_block
        for h in hashes[:max_blocks]:
            block = lookup.get(h)
            if block is None:
                break
            found.append(block)
        return PrefixMatch(tuple(found), num_query_tokens)

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
        """Gives an empty `table` the matched blocks, then new ones up to `num_tokens` tokens."""
        if table.block_ids:
            raise ValueError("allocate needs an empty table; use append to grow one")
        num_blocks = self.blocks_for(num_tokens)
        if len(match.block_ids) > num_blocks:
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
        self.num_hit_tokens += len(match.block_ids) * self.block_size
        self._take(table, num_blocks - len(match.block_ids))

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
            ref[b] = 1
            table.block_ids.append(b)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))

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
        lookup, block_hash = self._hash_to_block, self._hash
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

    def clear(self) -> None:
        """Forgets every cached hash (held blocks stay held but become private) and publishes
        AllBlocksCleared."""
        for b in self._hash_to_block.values():
            self._hash[b] = None
        self._hash_to_block.clear()
        self._empty.extend(self._cached_free)
        self._cached_free.clear()
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KvEvent]:
        """The events since the previous call, oldest first."""
        events, self._events = self._events, []
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
        if tables is None:
            return
        counts = [0] * self.total
        for table in tables:
            assert len(set(table.block_ids)) == len(table.block_ids), "table holds a block twice"
            for b in table.block_ids:
                counts[b] += 1
        assert counts == self._ref, "ref counts differ from the tables holding blocks"
