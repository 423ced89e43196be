from __future__ import annotations

import random

import pytest

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.kv.block_pool import BlockPool, BlockTable
from tandem.kv.hashing import block_hashes

BS = 4


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def admit(pool: BlockPool, tokens: list[int]) -> tuple[BlockTable, int]:
    """Allocates a table for `tokens` reusing the cache, commits its full blocks; returns
    (table, cached tokens)."""
    hashes = block_hashes(tokens, BS)
    max_blocks = (len(tokens) - 1) // BS
    match = pool.match_prefix(hashes, len(tokens), max_blocks)
    table = BlockTable()
    pool.allocate(table, len(tokens), match)
    pool.commit(table, tokens, hashes, len(tokens) // BS)
    return table, len(match.block_ids) * BS


def test_allocate_append_free_counters() -> None:
    pool = BlockPool(10, BS)
    table = BlockTable()
    assert pool.can_allocate(9)
    pool.allocate(table, 9)  # 3 blocks
    assert (pool.num_used, pool.num_free, pool.total) == (3, 7, 10)
    assert pool.can_append(table, 12) and len(table) == 3
    pool.append(table, 12)
    assert len(table) == 3  # still fits
    pool.append(table, 13)
    assert len(table) == 4 and pool.num_used == 4
    pool.free(table)
    assert (pool.num_used, pool.num_free, len(table)) == (0, 10, 0)
    pool.check_invariants([table])


def test_exhaustion_is_a_question_then_an_error() -> None:
    pool = BlockPool(3, BS)
    table = BlockTable()
    assert not pool.can_allocate(13)
    with pytest.raises(MemoryError):
        pool.allocate(table, 13)
    pool.allocate(table, 12)
    assert not pool.can_append(table, 13)
    with pytest.raises(MemoryError):
        pool.append(table, 13)
    pool.check_invariants([table])


def test_repeated_prompt_reuses_cached_blocks_and_counts_hits() -> None:
    pool = BlockPool(16, BS)
    prompt = seq(10, 10)  # 2 full blocks + 2 tokens
    first, cached = admit(pool, prompt)
    assert cached == 0
    first_ids = list(first.block_ids)
    pool.free(first)
    second, cached = admit(pool, prompt)
    assert cached == 8
    assert second.block_ids[:2] == first_ids[:2]  # the very same physical blocks
    assert pool.num_hit_tokens == 8 and pool.num_query_tokens == 20
    assert pool.prefix_hit_rate == pytest.approx(8 / 20)
    pool.check_invariants([second])


def test_prefix_match_leaves_at_least_one_token_to_compute() -> None:
    pool = BlockPool(16, BS)
    prompt = seq(0, 8)  # exactly 2 blocks
    table, _ = admit(pool, prompt)
    pool.free(table)
    _, cached = admit(pool, prompt)
    assert cached == 4  # capped at (8 - 1) // 4 blocks


def test_shared_prefix_of_running_sequences_is_ref_counted() -> None:
    pool = BlockPool(16, BS)
    a, _ = admit(pool, seq(0, 9))
    b, cached = admit(pool, seq(0, 8) + [77, 78, 79])
    assert cached == 8
    assert a.block_ids[:2] == b.block_ids[:2]
    assert pool.num_used == 3 + 1  # b added one private block
    pool.check_invariants([a, b])
    pool.free(a)
    pool.check_invariants([b])
    assert pool.num_used == 3
    pool.free(b)
    pool.check_invariants([])
    assert pool.num_used == 0


def test_stored_events_group_adjacent_blocks_with_parent_and_tokens() -> None:
    pool = BlockPool(16, BS)
    tokens = seq(0, 13)
    hashes = block_hashes(tokens, BS)
    table = BlockTable()
    pool.allocate(table, 13)
    pool.commit(table, tokens, hashes, 1)
    pool.commit(table, tokens, hashes, 3)
    events = pool.take_events()
    assert events == [
        BlockStored((hashes[0],), None, tuple(tokens[0:4]), BS),
        BlockStored((hashes[1], hashes[2]), hashes[0], tuple(tokens[4:12]), BS),
    ]
    assert pool.take_events() == []


def test_duplicate_content_publishes_nothing_and_stays_private() -> None:
    pool = BlockPool(16, BS)
    tokens = seq(0, 8)
    hashes = block_hashes(tokens, BS)
    a, b = BlockTable(), BlockTable()
    pool.allocate(a, 8)
    pool.allocate(b, 8)  # computed concurrently: no match yet
    pool.commit(a, tokens, hashes, 2)
    pool.take_events()
    pool.commit(b, tokens, hashes, 2)
    assert pool.take_events() == []
    assert pool.num_cached == 2
    pool.free(b)  # private duplicates go back empty, no removal events
    pool.free(a)
    assert pool.take_events() == []
    pool.check_invariants([])


def test_lru_evicts_least_recently_freed_and_publishes_removals() -> None:
    pool = BlockPool(4, BS)
    a_tokens, b_tokens = seq(0, 8), seq(100, 8)
    a, _ = admit(pool, a_tokens)
    b, _ = admit(pool, b_tokens)
    pool.take_events()
    pool.free(a)  # a's blocks are now the oldest idle ones
    pool.free(b)
    ha, hb = block_hashes(a_tokens, BS), block_hashes(b_tokens, BS)
    c = BlockTable()
    pool.allocate(c, 4)  # one block: evicts a's LAST block first
    assert pool.take_events() == [BlockRemoved((ha[1],))]
    pool.append(c, 12)  # two more: a's first block, then b's last
    assert pool.take_events() == [BlockRemoved((ha[0], hb[1]))]
    # b's first block is still cached and matchable
    assert len(pool.match_prefix(hb, 8, 2).block_ids) == 1
    pool.check_invariants([c])


def test_rematched_block_leaves_the_lru() -> None:
    pool = BlockPool(3, BS)
    a, _ = admit(pool, seq(0, 5))  # blocks: [full, partial]
    pool.free(a)
    b, cached = admit(pool, seq(0, 5))
    assert cached == 4
    # 1 block left free besides b's two; taking it and one more must fail, not evict b's
    assert pool.num_free == 1
    assert not pool.can_allocate(8)
    pool.check_invariants([b])


def test_clear_drops_every_cached_hash() -> None:
    pool = BlockPool(8, BS)
    a, _ = admit(pool, seq(0, 9))
    held, _ = admit(pool, seq(50, 9))
    pool.free(a)
    pool.take_events()
    pool.clear()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached == 0
    _, cached = admit(pool, seq(0, 9))
    assert cached == 0
    pool.free(held)
    pool.check_invariants()


def test_prefix_caching_disabled_has_no_hits_and_no_events() -> None:
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    a, _ = admit(pool, seq(0, 9))
    pool.free(a)
    _, cached = admit(pool, seq(0, 9))
    assert cached == 0 and pool.take_events() == [] and pool.num_cached == 0


def test_invariants_hold_under_random_operations() -> None:
    rng = random.Random(7)
    pool = BlockPool(24, BS)
    live: list[tuple[BlockTable, list[int]]] = []
    stored: set[int] = set()
    num_removed = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            # prompts from a few shared prefixes so that matches happen
            base = rng.choice([0, 1000, 2000])
            tokens = seq(base, rng.randint(1, 6) * 2) + seq(rng.randint(0, 5) * 7,
                                                             rng.randint(1, 9))
            hashes = block_hashes(tokens, BS)
            max_blocks = (len(tokens) - 1) // BS
            match = pool.match_prefix(hashes, len(tokens), max_blocks)
            if pool.can_allocate(len(tokens), match):
                table = BlockTable()
                pool.allocate(table, len(tokens), match)
                pool.commit(table, tokens, hashes, len(tokens) // BS)
                live.append((table, tokens))
            else:
                with pytest.raises(MemoryError):
                    pool.allocate(BlockTable(), len(tokens), match)
        elif op < 0.7 and live:
            table, tokens = rng.choice(live)
            tokens.extend(rng.randrange(1000) for _ in range(rng.randint(1, 5)))
            if pool.can_append(table, len(tokens)):
                pool.append(table, len(tokens))
                pool.commit(table, tokens, block_hashes(tokens, BS), len(tokens) // BS)
            else:
                del tokens[len(table) * BS:]
        elif live:
            table, _ = live.pop(rng.randrange(len(live)))
            pool.free(table)
        for event in pool.take_events():
            if isinstance(event, BlockStored):
                assert not stored & set(event.block_hashes), "hash stored twice"
                stored.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= stored, "removed a hash never stored"
                stored.difference_update(event.block_hashes)
                num_removed += len(event.block_hashes)
        pool.check_invariants([t for t, _ in live])
        assert stored == set(pool._hash_to_block)  # events mirror the cache exactly
    for table, _ in live:
        pool.free(table)
    pool.check_invariants([])
    assert pool.num_used == 0 and pool.num_free == pool.total
    assert num_removed > 0 and pool.num_hit_tokens > 0  # eviction and reuse were exercised
