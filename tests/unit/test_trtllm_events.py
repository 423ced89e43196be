"""TensorRT-LLM KV events and stats in Tandem's terms: the translator on hand-written event
dicts in upstream's serializer shape, then end to end from the fake's block manager, whose
hashes must come out as tandem.kv.hashing's chain over the same tokens."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.trtllm.events import KvEventTranslator
from tandem.engines.trtllm.stats import engine_stats
from tandem.engines.types import BlockRemoved, BlockStored, EngineRequest, KvEvent, SamplingParams
from tandem.kv.hashing import block_hashes
from tests.unit.fake_packages import fake_trtllm  # noqa: F401 (autouse: tensorrt_llm is the fake)

BIG = (1 << 64) - 5  # an engine hash past 2^63: negative if read as int64




def created(window: int, event_id: int = 0) -> dict[str, Any]:
    return {"event_id": event_id, "window_size": window,
            "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}}


def stored(parent: int | None, blocks: Sequence[tuple[int, Sequence[int]]],
           window: int = 4096) -> dict[str, Any]:
    return {"event_id": 1, "window_size": window, "data": {
        "type": "stored", "parent_hash": parent, "blocks": [
            {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                        for t in tokens]} for h, tokens in blocks]}}


def removed(hashes: Sequence[int], window: int = 4096) -> dict[str, Any]:
    return {"event_id": 2, "window_size": window,
            "data": {"type": "removed", "block_hashes": list(hashes)}}


def test_stored_blocks_get_tandem_chained_hashes() -> None:
    tr = KvEventTranslator(block_size=2)
    tr.translate(created(4096))
    [event] = tr.translate(stored(None, [(11, [1, 2]), (BIG, [3, 4])]))
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(block_hashes([1, 2, 3, 4], 2))
    assert event.parent_hash is None and event.token_ids == (1, 2, 3, 4)
    assert event.block_size == 2
    # A later event continues the chain through TensorRT-LLM's parent hash.
    [more] = tr.translate(stored(BIG, [(12, [5, 6])]))
    assert isinstance(more, BlockStored)
    assert more.parent_hash == event.block_hashes[-1]
    assert more.block_hashes == tuple(block_hashes([1, 2, 3, 4, 5, 6], 2))[2:]


def test_hashes_are_unsigned_64_bit() -> None:
    tr = KvEventTranslator(block_size=2)
    [event] = tr.translate(stored(None, [(BIG, [1, 2])]))
    signed = BIG - (1 << 64)  # the same hash as a signed binding would hand it over
    [more] = tr.translate(stored(signed, [(7, [3, 4])]))
    assert isinstance(more, BlockStored) and more.parent_hash == event.block_hashes[0]
    [gone] = tr.translate(removed([signed]))
    assert gone == BlockRemoved(event.block_hashes)
    for h in (*event.block_hashes, *more.block_hashes):
        assert 0 <= h < 1 << 64


def test_partial_blocks_and_their_removal_are_dropped() -> None:
    tr = KvEventTranslator(block_size=4)
    [event] = tr.translate(stored(None, [(1, [1, 2, 3, 4]), (2, [5, 6])]))
    assert isinstance(event, BlockStored) and event.token_ids == (1, 2, 3, 4)
    assert tr.translate(stored(1, [(3, [5])])) == []  # a lone partial block
    assert tr.translate(removed([2, 3])) == []        # their removals
    [gone] = tr.translate(removed([2, 1]))
    assert gone == BlockRemoved(event.block_hashes)
    assert tr.num_blocks == 0


def test_non_global_windows_are_dropped_and_created_ignored() -> None:
    tr = KvEventTranslator(block_size=2)
    assert tr.translate(created(128)) == [] and tr.translate(created(4096, 1)) == []
    assert tr.max_window == 4096
    assert tr.translate(stored(None, [(1, [1, 2])], window=128)) == []
    [event] = tr.translate(stored(None, [(1, [1, 2])], window=4096))
    assert isinstance(event, BlockStored)
    assert tr.translate(removed([1], window=128)) == []
    assert tr.translate(removed([1], window=4096)) == [BlockRemoved(event.block_hashes)]
    # Created events after the first real one no longer move the global window.
    tr.translate(created(999_999))
    assert tr.max_window == 4096


def test_events_without_window_are_kept_and_odd_ones_dropped() -> None:
    tr = KvEventTranslator(block_size=2)
    event = stored(None, [(1, [1, 2])])
    del event["window_size"]  # older TensorRT-LLM versions
    assert len(tr.translate(event)) == 1
    assert tr.translate(stored(99, [(5, [3, 4])])) == []  # parent never seen
    assert tr.translate(stored(None, [(6, [1, 2, 3])])) == []  # more than a block
    assert tr.translate({"event_id": 3, "window_size": 4096, "data": {
        "type": "updated", "block_hash": 1, "cache_level": {}, "priority": {}}}) == []


def test_stats_translation() -> None:
    stat = {"numActiveRequests": 3, "numQueuedRequests": 2,
            "kvCacheStats": {"maxNumBlocks": 1000, "freeNumBlocks": 400, "usedNumBlocks": 600,
                             "cacheHitRate": 0.25, "tokensPerBlock": 32},
            "inflightBatchingStats": {"numPausedRequests": 1, "numCtxTokens": 512}}
    stats = engine_stats(stat, num_in_flight=6)
    assert (stats.num_running, stats.num_waiting) == (3, 3)
    assert (stats.kv_blocks_used, stats.kv_blocks_total) == (600, 1000)
    assert stats.active_decode_blocks == 600 and stats.pending_prefill_tokens == 512
    assert stats.prefix_cache_hit_rate == 0.25
    clamped = engine_stats(stat, num_in_flight=2)  # a stale report of a busier moment
    assert (clamped.num_running, clamped.num_waiting) == (2, 0)
    idle = engine_stats(stat, num_in_flight=0)
    assert (idle.num_running, idle.num_waiting, idle.kv_blocks_used) == (0, 0, 0)
    assert idle.kv_blocks_total == 1000
    before_first = engine_stats(None, num_in_flight=1)
    assert before_first.num_waiting == 1 and before_first.kv_blocks_total == 0
    no_used = engine_stats({"kvCacheStats": {"maxNumBlocks": 10, "freeNumBlocks": 7}}, 1)
    assert no_used.kv_blocks_used == 3


async def _run(engine: Any, requests: Sequence[tuple[str, tuple[int, ...], int]]) -> None:
    for rid, prompt, max_tokens in requests:
        async for _ in engine.add_request(EngineRequest(
                rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))):
            pass


async def _settle(engine: Any, published: list[KvEvent]) -> None:
    """Waits until the poller has drained the fake's event queue."""
    queue = engine._llm._executor.kv_events.aqueue
    for _ in range(500):
        if not queue._q and not engine.telemetry._pending:
            await asyncio.sleep(0.02)
            if not queue._q:
                return
        await asyncio.sleep(0.005)
    raise AssertionError("KV events were not drained")


@pytest.mark.parametrize("windows", [None, [8, 2048]])
async def test_engine_publishes_tandem_hashes(tiny_model: str,
                                              windows: list[int] | None) -> None:
    from tandem.engines.trtllm.engine import create_trtllm_engine

    override = {"kv_cache_config": {"max_attention_window": windows}} if windows else {}
    engine = create_trtllm_engine(EngineArgs(
        model=tiny_model, kv_block_size=4, num_gpu_blocks=12,
        override_engine_args=json.dumps(override)))
    published: list[KvEvent] = []
    engine.set_event_sink(published.extend)
    await engine.start()
    try:
        prompt = tuple(range(10, 23))  # 13 tokens
        await _run(engine, [("a", prompt, 6)])
        await _settle(engine, published)
        # The KV holds the prompt and all output tokens but the last (not yet computed): 18
        # tokens, 4 full blocks announced; the partial fifth block is not.
        tokens = list(prompt) + [t for e in published if isinstance(e, BlockStored)
                                 for t in e.token_ids][len(prompt):]
        stored_hashes = [h for e in published if isinstance(e, BlockStored)
                         for h in e.block_hashes]
        assert len(stored_hashes) == 4 and len(set(stored_hashes)) == 4  # one window's copy
        assert stored_hashes == block_hashes(tokens[:16], 4)
        # Evictions: other prompts fill the 12-block pool; removals name announced blocks.
        await _run(engine, [(f"b{i}", tuple(range(100 + 20 * i, 113 + 20 * i)), 6)
                            for i in range(4)])
        await _settle(engine, published)
        removed_hashes = [h for e in published if isinstance(e, BlockRemoved)
                          for h in e.block_hashes]
        announced = {h for e in published if isinstance(e, BlockStored) for h in e.block_hashes}
        assert removed_hashes and set(removed_hashes) <= announced
        assert len(removed_hashes) == len(set(removed_hashes))
        assert engine.telemetry.translator.num_blocks == len(announced) - len(removed_hashes)
    finally:
        await engine.close()
