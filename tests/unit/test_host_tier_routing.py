"""Tiers in the router and in TensorRT-LLM's events: the prefix index matches as the engine does
(a device run, then a host run), against a brute-force model under random events of both
tiers; the kv policy ranks a device hit above a host hit above none, by the documented weight;
the event log's snapshot and the wire format keep the tier; TensorRT-LLM's cache-level updates
(its host offload) become tier moves, end to end from the fake's secondary block pool."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.trtllm.args import from_flags
from tandem.engines.trtllm.events import KvEventTranslator
from tandem.engines.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvTier,
)
from tandem.errors import InvalidRequest
from tandem.kv.event_log import EventLog
from tandem.kv.hashing import block_hashes
from tandem.routing.config import PoolConfig
from tandem.routing.policies import DEFAULT_HOST_HIT_COST, KvPolicy
from tandem.routing.prefix_index import PrefixIndex, TierOverlap
from tandem.routing.router import Router
from tandem.routing.workers import RouteContext, SlaHints, WorkerRef, WorkerState
from tandem.runtime.convert import kv_event_from_pb, kv_event_to_pb
from tandem.v1 import kv_events_pb2
from tests.unit.fake_packages import faked
from tests.unit.test_trtllm_events import _run, _settle

BS = 16
HOST, DEVICE = KvTier.HOST, KvTier.DEVICE


def stored(hashes: list[int], tier: KvTier = DEVICE, parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(range(len(hashes) * BS)), BS, (), tier)


def test_a_match_runs_through_the_device_tier_then_the_host_tier() -> None:
    index = PrefixIndex()
    index.apply("dev", [stored([1, 2, 3, 4])])
    index.apply("split", [stored([1, 2]), stored([3, 4], HOST)])
    index.apply("host", [stored([1, 2, 3], HOST)])
    index.apply("back", [stored([1], HOST), stored([2, 3])])  # device after host: not taken
    assert index.overlaps_by_tier([1, 2, 3, 4]) == {
        "dev": TierOverlap(4, 0), "split": TierOverlap(2, 2), "host": TierOverlap(0, 3),
        "back": TierOverlap(0, 1)}
    assert index.overlaps([1, 2, 3, 4]) == {"dev": 4, "split": 4, "host": 3, "back": 1}
    index.apply("split", [BlockRemoved((3,), HOST)])
    assert index.overlaps_by_tier([1, 2, 3, 4])["split"] == TierOverlap(2, 0)
    index.apply("split", [AllBlocksCleared()])
    assert "split" not in index.overlaps([1, 2, 3, 4])
    assert index.num_blocks_of("host") == 3 and index.blocks_of("host", HOST) == {1, 2, 3}


def _brute_force(model: dict[str, dict[KvTier, set[int]]], query: list[int]
                 ) -> dict[str, TierOverlap]:
    result = {}
    for worker, tiers in model.items():
        device = 0
        while device < len(query) and query[device] in tiers[DEVICE]:
            device += 1
        host = 0
        while device + host < len(query) and query[device + host] in tiers[HOST]:
            host += 1
        if device + host:
            result[worker] = TierOverlap(device, host)
    return result


@pytest.mark.parametrize("seed", [0, 1])
def test_tiered_overlaps_match_a_brute_force_model(seed: int) -> None:
    rng = random.Random(seed)
    paths: list[list[int]] = []
    for _ in range(30):
        base = rng.choice(paths)[:rng.randint(0, 5)] if paths and rng.random() < 0.7 else []
        tokens = [rng.randrange(50_000) for _ in range(rng.randint(1, 7) * BS)]
        paths.append(base + block_hashes(tokens, BS, parent_hash=base[-1] if base else None))
    workers = [f"w{i}" for i in range(5)]
    index = PrefixIndex()
    model = {w: {DEVICE: set(), HOST: set()} for w in workers}
    for step in range(500):
        w, path, tier = rng.choice(workers), rng.choice(paths), rng.choice([DEVICE, HOST])
        op = rng.random()
        if op < 0.5:
            lo = rng.randrange(len(path))
            chunk = path[lo:rng.randint(lo + 1, len(path))]
            index.apply(w, [stored(chunk, tier)])
            model[w][tier].update(chunk)
        elif op < 0.9:
            victims = rng.sample(path, rng.randint(1, len(path)))
            index.apply(w, [BlockRemoved(tuple(victims), tier)])
            model[w][tier].difference_update(victims)
        elif op < 0.95:
            index.apply(w, [AllBlocksCleared()])
            model[w] = {DEVICE: set(), HOST: set()}
        else:
            index.remove_worker(w)
            model[w] = {DEVICE: set(), HOST: set()}
        for query in rng.sample(paths, 3):
            assert index.overlaps_by_tier(query) == _brute_force(model, query), step
    assert index.num_blocks == sum(len(t[DEVICE]) + len(t[HOST]) for t in model.values())


def worker(worker_id: str, prefill: int = 0, decode: int = 0) -> WorkerState:
    state = WorkerState(WorkerRef(worker_id, worker_id, "p"), block_size=BS, healthy=True)
    state.report(prefill, decode, 0)
    return state


def test_the_kv_policy_prices_a_host_hit_between_a_device_hit_and_a_recompute() -> None:
    index = PrefixIndex()
    hashes = list(range(1, 11))
    index.apply("device", [stored(hashes)])
    index.apply("host", [stored(hashes, HOST)])
    policy = KvPolicy(index, prefill_load_scale=1.0)
    ctx = RouteContext("r", tuple(hashes), 10 * BS, 8, SlaHints())
    ws = [worker("cold"), worker("host"), worker("device")]
    assert [w.worker_id for w, _ in policy.rank(ws, ctx)] == ["device", "host", "cold"]
    assert policy.cost(ws[1], ctx, TierOverlap(0, 10)) == pytest.approx(
        10 * DEFAULT_HOST_HIT_COST)
    # A host hit costs 10 * 0.3 = 3 blocks here: a device-hit worker with 4 blocks of queued
    # prefill (cost 4) loses to it.
    loaded = [worker("host"), worker("device", prefill=4)]
    assert policy.rank(loaded, ctx)[0][0].worker_id == "host"
    assert [overlap for _, overlap in policy.rank(ws, ctx)] == [10, 10, 0]
    with pytest.raises(InvalidRequest):
        KvPolicy(index, host_hit_cost=1.5)


def test_the_router_takes_the_pools_host_hit_cost() -> None:
    pool = PoolConfig(name="p", kind="decode", workers=["a:1"], policy="kv", host_hit_cost=1.0)
    router = Router([pool], None, BS, 1024)
    assert router.pools[0].policy.host_hit_cost == 1.0  # type: ignore[attr-defined]


def test_the_snapshot_and_the_wire_keep_each_tier() -> None:
    log = EventLog()
    log.append([stored([1, 2]), stored([3], DEVICE, parent=2)])
    log.append([BlockRemoved((2, 3)), stored([2], HOST, parent=1), stored([3], HOST, parent=2)])
    log.append([stored([2], DEVICE, parent=1)])  # onboarded: in both tiers now
    _, blocks = log.snapshot()
    seen = [(b.block_hashes[0], b.tier) for b in blocks]
    assert sorted(seen, key=str) == sorted([(1, DEVICE), (2, HOST), (2, DEVICE), (3, HOST)],
                                           key=str)
    assert seen.index((3, HOST)) > max(seen.index((2, HOST)), seen.index((2, DEVICE)))
    for event in [stored([5], HOST), BlockRemoved((5,), HOST), stored([6]), BlockRemoved((6,))]:
        assert kv_event_from_pb(kv_event_to_pb(event)) == event
    older = kv_events_pb2.KvEvent(removed=kv_events_pb2.BlockRemoved(block_hashes=[7]))
    assert kv_event_from_pb(older) == BlockRemoved((7,), DEVICE)  # an older worker: device


# ---- TensorRT-LLM ---------------------------------------------------------------------------


def test_kv_host_cache_bytes_maps_to_host_cache_size() -> None:
    kv = from_flags(EngineArgs(kv_host_cache_bytes=1 << 30))["kv_cache_config"]
    assert kv["host_cache_size"] == 1 << 30
    assert "host_cache_size" not in from_flags(EngineArgs())["kv_cache_config"]


def _stored(parent: int | None, engine_hash: int, tokens: range, level: int = 0
            ) -> dict[str, Any]:
    return {"event_id": 1, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent, "blocks": [
            {"type": "stored_block", "block_hash": engine_hash, "cache_level": level,
             "priority": 35, "tokens": [{"type": "unique_token", "token_id": t,
                                          "token_extra_id": 0} for t in tokens]}]}}


def _updated(engine_hash: int, old: int, new: int) -> dict[str, Any]:
    return {"event_id": 2, "window_size": 64, "data": {
        "type": "updated", "block_hash": engine_hash, "priority": None,
        "cache_level": {"type": "event_diff", "old_value": old, "new_value": new}}}


def test_cache_level_updates_become_tier_moves() -> None:
    t = KvEventTranslator(4)
    (first,) = t.translate(_stored(None, 11, range(4)))
    assert first.tier is DEVICE
    h = first.block_hashes[0]
    assert t.translate(_updated(11, 0, 1)) == [
        BlockRemoved((h,), DEVICE), BlockStored((h,), None, (0, 1, 2, 3), 4, (), HOST)]
    assert t.translate(_updated(11, 1, 1)) == []  # no move
    assert t.translate({"event_id": 3, "window_size": 64, "data": {
        "type": "updated", "block_hash": 11, "cache_level": None,
        "priority": {"type": "event_diff", "old_value": 35, "new_value": 50}}}) == []
    assert t.translate({"event_id": 4, "window_size": 64, "data": {
        "type": "removed", "block_hashes": [11]}}) == [BlockRemoved((h,), HOST)]
    (child,) = t.translate(_stored(None, 12, range(4), level=1))  # stored straight to host
    assert child.tier is HOST


@pytest.fixture(scope="module")
def fake_trtllm() -> Iterator[None]:
    with faked("tensorrt_llm"):
        yield


async def test_trtllm_offload_and_onboard_reach_the_index_as_tiers(
        tiny_model: str, fake_trtllm: None) -> None:
    from tensorrt_llm._fake.settings import knobs

    from tandem.engines.trtllm.engine import create_trtllm_engine

    engine = create_trtllm_engine(EngineArgs(
        model=tiny_model, kv_block_size=4, num_gpu_blocks=12,
        kv_host_cache_bytes=32 * knobs.block_bytes,
        override_engine_args=json.dumps({"kv_cache_config": {"max_attention_window": [64]}})))
    published: list[KvEvent] = []
    index = PrefixIndex()

    def sink(events: Any) -> None:
        published.extend(events)
        index.apply("w", events)

    engine.set_event_sink(sink)
    await engine.start()
    try:
        prompt = tuple(range(10, 23))
        await _run(engine, [("a", prompt, 6)])
        await _run(engine, [(f"b{i}", tuple(range(100 + 20 * i, 113 + 20 * i)), 6)
                            for i in range(4)])
        await _settle(engine, published)
        blocks = engine._llm._executor.blocks
        assert blocks.offloaded > 0
        host = index.blocks_of("w", HOST)
        assert host  # (partial blocks are offloaded too, but never announced)
        await _run(engine, [("a2", prompt, 6)])  # its blocks come back from the secondary pool
        await _settle(engine, published)
        assert blocks.onboarded > 0
        translator = engine.telemetry.translator
        want = {tier: {k.tandem_hash for k in translator._known.values() if k.tier is tier}
                for tier in KvTier}
        assert index.blocks_of("w", HOST) == want[HOST]
        assert index.blocks_of("w", DEVICE) == want[DEVICE]
        assert {translator._known[e].tandem_hash for e in blocks.secondary_hashes
                if e in translator._known} == want[HOST]
        assert any(isinstance(e, BlockStored) and e.tier is DEVICE and
                   set(e.block_hashes) & host for e in published)
    finally:
        await engine.close()
