"""The host KV tier in the block pool and the batching engine (mock backend): evicted blocks go
to host memory, a prefix match continues there and comes back through queued copies, a full
tier drops its oldest unpinned block, and under churn both tiers stay consistent after every
step while the router's index, fed by the engine's events (over the wire format, and from a
resync snapshot), equals both tiers exactly. A failed copy recomputes; a cancel during an
onboard leaks nothing."""
from __future__ import annotations

import asyncio
import random

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.mock.engine import MockEngine, create_mock_engine
from tandem.engines.types import (
    BlockRemoved,
    BlockStored,
    EngineRequest,
    FinishReason,
    KvTier,
    SamplingParams,
)
from tandem.errors import InvalidRequest
from tandem.kv.block_pool import BlockPool, BlockTable
from tandem.kv.event_log import EventLog
from tandem.kv.hashing import block_hashes
from tandem.kv.host_tier import HostTier
from tandem.routing.prefix_index import PrefixIndex
from tandem.runtime.convert import kv_event_from_pb, kv_event_to_pb

BS = 4
#: The conftest model's block: K and V x 2 layers x 4 tokens x 2 KV heads x 16 dims x 2 bytes.
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 2


def seq(start: int, n: int) -> list[int]:
    return [10 + (start + i) % 900 for i in range(n)]


def admit(pool: BlockPool, tokens: list[int]) -> tuple[BlockTable, int, int]:
    """Allocates and commits like the scheduler; returns (table, device hits, host hits)."""
    hashes = block_hashes(tokens, BS)
    max_blocks = (len(tokens) - 1) // BS
    match = pool.match_prefix(hashes, len(tokens), max_blocks)
    table = BlockTable()
    pool.allocate(table, len(tokens), match)
    pool.commit(table, tokens, hashes, len(tokens) // BS)
    return table, len(match.block_ids), len(match.host_slots)


def settle(pool: BlockPool) -> None:
    """What the engine does with a step's copies (no bytes here): issue, then unpin."""
    assert pool.host is not None
    for slot, _ in pool.take_copies().onboards:
        pool.host.unpin(slot)


def test_eviction_offloads_and_a_match_continues_into_the_host_tier() -> None:
    pool = BlockPool(4, BS, num_host_blocks=8)
    first = seq(0, 13)  # 3 full blocks
    table, _, _ = admit(pool, first)
    cached_blocks = table.block_ids[:3]
    pool.free(table)
    pool.take_events()
    other, _, _ = admit(pool, seq(100, 16))  # needs all 4 blocks: evicts the 3 cached
    copies = pool.take_copies()
    assert sorted(block for block, _ in copies.offloads) == cached_blocks
    assert not copies.onboards
    hashes = block_hashes(first, BS)
    assert pool.host is not None and pool.host.hashes() == set(hashes)
    events = pool.take_events()
    assert BlockRemoved(tuple(hashes[::-1]), KvTier.DEVICE) in events  # freed tail first
    host_stored = [e for e in events if isinstance(e, BlockStored) and e.tier is KvTier.HOST]
    assert [e.block_hashes[0] for e in host_stored] == hashes[::-1]
    assert host_stored[0].parent_hash == hashes[1]  # metadata kept from the commit
    pool.free(other)

    again, device_hits, host_hits = admit(pool, first)
    assert (device_hits, host_hits) == (0, 3)
    pool.check_invariants([again])  # the three slots are pinned for their pending onboards
    copies = pool.take_copies()
    assert [block for _, block in copies.onboards] == again.block_ids[:3]
    for slot, _ in copies.onboards:
        pool.host.unpin(slot)
    pool.check_invariants([again])
    assert pool.host_hit_rate > 0 and pool.prefix_hit_rate >= pool.host_hit_rate
    pool.free(again)
    assert pool.num_used == 0


def one(h: int) -> BlockStored:
    return BlockStored((h,), None, tuple(range(BS)), BS, (), KvTier.HOST)


def test_a_full_host_tier_drops_the_oldest_unpinned_block_and_never_waits() -> None:
    events: list = []
    tier = HostTier(2, BS, events)
    a, b = tier.store(one(1)), tier.store(one(2))
    assert a is not None and b is not None
    assert tier.store(one(1)) is None  # held already: touched, 2 is now the oldest
    tier.pin(a)
    c = tier.store(one(3))
    assert c == b and tier.lookup(2) is None and BlockRemoved((2,), KvTier.HOST) in events
    tier.pin(c)
    assert tier.store(one(4)) is None and tier.num_dropped == 1  # all pinned: dropped
    tier.check_invariants([a, c])
    tier.forget(a)  # a failed copy: its bytes cannot be trusted
    assert tier.lookup(1) is None
    tier.unpin(a)
    tier.unpin(c)
    tier.check_invariants([])
    assert tier.num_used == 1 and tier.hashes() == {3}


async def test_both_tiers_and_the_router_index_agree_under_churn(tiny_model: str) -> None:
    # Device pool of 16 blocks, host tier of 12: shared prefixes, aborts, preemption and
    # evictions in both tiers.
    engine = create_mock_engine(EngineArgs(
        model=tiny_model, kv_block_size=BS, num_gpu_blocks=16, speedup_ratio=0,
        max_num_tokens=24, kv_host_cache_bytes=12 * BLOCK_BYTES, mock_kv_host_gbps=0))
    log, index, wire_index = EventLog(), PrefixIndex(), PrefixIndex()

    def sink(events: object) -> None:
        batch = list(events)  # type: ignore[call-overload]
        log.append(batch)
        index.apply("w", batch)
        wire_index.apply("w", [kv_event_from_pb(kv_event_to_pb(e)) for e in batch])

    engine.set_event_sink(sink)
    host = engine.pool.host
    assert host is not None
    rng = random.Random(5)
    shared = [seq(1000 * k, 12) for k in range(3)]  # three 3-block system prompts
    live: list[str] = []
    for step in range(500):
        if rng.random() < 0.35:
            rid = f"r{step}"
            tokens = rng.choice(shared) + seq(rng.randrange(5000), rng.randrange(1, 16))
            engine.add_request(EngineRequest(rid, tuple(tokens), SamplingParams(
                max_tokens=rng.randrange(1, 12), ignore_eos=True)))
            live.append(rid)
        if live and rng.random() < 0.08:
            engine.abort(live.pop(rng.randrange(len(live))))
        if engine.scheduler.has_work:
            await engine._step()
        engine.pool.check_invariants([r.table for r in engine._requests.values()])
        for idx in (index, wire_index):
            assert idx.blocks_of("w", KvTier.DEVICE) == engine.pool.hashes(), step
            assert idx.blocks_of("w", KvTier.HOST) == host.hashes(), step
        live = [rid for rid in live if rid in engine._requests]
    stats = engine.stats()
    assert host.num_evicted > 0 and stats.kv_onboard_blocks > 0 and stats.kv_offload_blocks > 0
    assert engine.scheduler.num_preemptions > 0
    assert stats.kv_host_blocks_used == host.num_cached  # no slot left pinned
    # A router that subscribes now gets the same from the resync snapshot.
    _, snapshot = log.snapshot()
    fresh = PrefixIndex()
    fresh.reset("w", snapshot)
    assert fresh.blocks_of("w", KvTier.HOST) == host.hashes()
    assert fresh.blocks_of("w", KvTier.DEVICE) == engine.pool.hashes()
    await engine.close()
    assert engine.pool.num_used == 0


async def run(engine: MockEngine, rid: str, tokens: list[int], max_tokens: int = 4
              ) -> tuple[list[int], int, FinishReason | None]:
    stream = engine.add_request(EngineRequest(rid, tuple(tokens), SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)))
    out: list[int] = []
    cached, finish = 0, None
    async for chunk in stream:
        out += chunk.token_ids
        if chunk.usage is not None:
            cached, finish = chunk.usage.cached_tokens, chunk.finish_reason
    return out, cached, finish


async def evicted_to_host(tiny_model: str, gbps: float = 0.0) -> tuple[MockEngine, list[int]]:
    """A started engine whose 8-block pool had to move a 5-block prompt to the host tier."""
    engine = create_mock_engine(EngineArgs(
        model=tiny_model, kv_block_size=BS, num_gpu_blocks=8, speedup_ratio=0,
        kv_host_cache_bytes=32 * BLOCK_BYTES, mock_kv_host_gbps=gbps))
    await engine.start()
    first = seq(0, 21)
    await run(engine, "first", first)
    await run(engine, "filler", seq(500, 28))  # with its output, the whole pool
    assert engine.pool.host is not None
    assert set(block_hashes(first, BS)) <= engine.pool.host.hashes()
    return engine, first


async def test_host_hits_count_as_cached_tokens_and_copies_take_their_modelled_time(
        tiny_model: str) -> None:
    gbps = BLOCK_BYTES / 0.002 / 1e9  # 2 ms per block
    engine, first = await evicted_to_host(tiny_model, gbps)
    offloaded = engine.stats().kv_offload_blocks
    _, cached, _ = await run(engine, "again", first)
    stats = engine.stats()
    assert cached == 5 * BS and stats.kv_onboard_blocks == 5
    assert stats.kv_onboard_bytes == 5 * BLOCK_BYTES
    assert stats.kv_onboard_seconds == pytest.approx(5 * 0.002)
    assert stats.kv_offload_seconds == pytest.approx(stats.kv_offload_blocks * 0.002)
    assert stats.kv_offload_blocks >= offloaded and stats.kv_host_hit_rate > 0
    assert stats.kv_host_blocks_total == 32
    await engine.close()


async def test_a_failed_copy_recomputes_and_forgets_the_blocks(tiny_model: str) -> None:
    engine, first = await evicted_to_host(tiny_model)
    expected, _, _ = await run(engine, "reference", seq(700, 9))  # warms nothing we need
    copy = engine.host_copies.copy_blocks
    failures = 0

    async def failing(copies, sync):  # type: ignore[no-untyped-def]
        nonlocal failures
        if copies.onboards and not failures:
            failures += 1
            raise RuntimeError("copy engine fault")
        return await copy(copies, sync)

    engine.host_copies.copy_blocks = failing
    preempted = engine.scheduler.num_preemptions
    tokens, _, finish = await run(engine, "again", first)
    assert finish == FinishReason.LENGTH and len(tokens) == 4
    assert engine.host_copies.num_failed == 1
    assert engine.scheduler.num_preemptions == preempted + 1
    host = engine.pool.host
    assert host is not None
    hashes = block_hashes(first, BS)
    # The onboarded blocks were forgotten in both tiers, then recomputed into the device pool.
    assert not set(hashes[:5]) & host.hashes()
    assert set(hashes[:5]) <= engine.pool.hashes()
    engine.pool.check_invariants([])
    host.check_invariants([])
    assert expected  # the engine still served other work before the fault
    await engine.close()


async def test_cancel_during_an_onboard_leaks_nothing(tiny_model: str) -> None:
    gbps = BLOCK_BYTES / 0.04 / 1e9  # 40 ms per block: the onboard is long enough to hit
    engine, first = await evicted_to_host(tiny_model, gbps)
    stream = engine.add_request(EngineRequest("again", tuple(first), SamplingParams(
        max_tokens=4, ignore_eos=True)))
    while not engine.host_copies.is_copying:
        await asyncio.sleep(0.005)
    assert engine.abort("again")
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].finish_reason == FinishReason.CANCELLED
    while engine.host_copies.is_copying or engine.scheduler.has_work:
        await asyncio.sleep(0.01)
    assert engine.pool.num_used == 0
    engine.pool.check_invariants([])
    assert engine.pool.host is not None
    engine.pool.host.check_invariants([])  # the onboard's pins are gone
    _, cached, finish = await run(engine, "after", first)  # the tier still serves the prefix
    assert finish == FinishReason.LENGTH and cached == 5 * BS
    await engine.close()


@pytest.mark.parametrize(("overrides", "param"), [
    ({"kv_host_cache_bytes": -1}, "kv_host_cache_bytes"),
    ({"kv_host_cache_bytes": BLOCK_BYTES - 1}, "kv_host_cache_bytes"),
    ({"kv_host_cache_bytes": BLOCK_BYTES, "enable_prefix_caching": False},
     "kv_host_cache_bytes"),
    ({"mock_kv_host_gbps": -1.0}, "mock_kv_host_gbps"),
])
def test_bad_host_tier_flags_are_refused_by_name(tiny_model: str, overrides: dict,
                                                 param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        create_mock_engine(EngineArgs(model=tiny_model, kv_block_size=BS, **overrides))
    assert info.value.param == param


async def test_a_prefill_worker_onboards_its_host_prefix_before_prefilling(
        tiny_model: str) -> None:
    engine, first = await evicted_to_host(tiny_model)
    prompt = first + seq(300, 6)
    result = await engine.prefill(EngineRequest("p", tuple(prompt), SamplingParams(
        max_tokens=4, ignore_eos=True)), lease_ms=10_000)
    assert result.cached_tokens == 5 * BS and engine.stats().kv_onboard_blocks == 5
    handle = result.kv_handle
    assert handle is not None
    # The decode worker reads device blocks: the lease holds the onboarded ones, now cached
    # on the device under the prompt's hashes.
    hashes = block_hashes(prompt, BS)
    assert handle.block_hashes[:5] == tuple(hashes[:5])
    assert set(hashes[:5]) <= engine.pool.hashes()
    assert await engine.release("p")
    assert engine.pool.num_used == 0
    await engine.close()
