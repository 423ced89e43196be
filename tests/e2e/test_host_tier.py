"""The host KV tier with real processes (mock engine, --kv-host-cache-bytes, a slow simulated
host link so that copies take long enough to hit): the router's index, fed over gRPC, equals
both tiers of the worker after a burst with evictions in both; a client that cancels during an
onboard and a worker killed during an offload leave nothing behind, and every request ends
cleanly (the killed worker's request completes on the other one)."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable

import grpc
import openai

from tandem.engines.types import KvTier
from tandem.kv.hashing import block_hashes
from tandem.routing.prefix_index import PrefixIndex
from tandem.routing.watcher import WorkerWatcher
from tandem.routing.workers import WorkerRef, WorkerState
from tandem.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_events_pb2,
    kv_events_pb2_grpc,
    worker_pb2,
)
from tests.e2e.disagg_probe import child_pid, generate, stats, wait_idle
from tests.e2e.test_router_index import burst, settled
from tests.e2e.topology import start_topology, start_worker

#: The demo model's KV block (2 layers, 2 KV heads of 16, float32, 32 tokens).
BLOCK_BYTES = 16384
#: A simulated host link at which one block takes 0.25 s to copy.
SLOW_GBPS = str(BLOCK_BYTES / 0.25 / 1e9)
TIER_FLAGS = ("--speedup-ratio", "0", "--kv-block-size", "32", "--num-gpu-blocks-override",
              "8")


def tokens(seed: int, n: int = 150) -> list[int]:
    return [(seed * 131 + j) % 3000 + 10 for j in range(n)]


async def tiers(address: str) -> tuple[int, dict[KvTier, set[int]]]:
    """The worker's own view of both tiers: a fresh subscription's snapshot."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = kv_events_pb2_grpc.KvEventsStub(channel).Subscribe(kv_events_pb2.SubscribeRequest())
        first = await call.read()
        call.cancel()
    out: dict[KvTier, set[int]] = {KvTier.DEVICE: set(), KvTier.HOST: set()}
    for block in first.resync.blocks:
        tier = KvTier.HOST if block.tier == kv_events_pb2.KV_TIER_HOST else KvTier.DEVICE
        out[tier].update(block.block_hashes)
    return first.resync.sequence, out


async def host_tier_settles(address: str, timeout_s: float = 30) -> None:
    """Until the host slots in use are exactly the blocks the tier holds (a copy still running
    when the requests ended keeps its slots pinned until its step ends; a leaked pin would
    keep them forever)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, truth = await tiers(address)
        used = stats(address).kv_host_blocks_used
        if len(truth[KvTier.HOST]) == used:
            return
        assert time.monotonic() < deadline, (len(truth[KvTier.HOST]), used)
        await asyncio.sleep(0.05)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def prompt_hashes(i: int) -> list[int]:
    """The block hashes of burst()'s prompt `i` (3 full blocks of 32)."""
    return block_hashes([(i * 131 + j) % 3000 + 10 for j in range(100)], 32)


async def test_the_router_index_equals_both_tiers_after_a_burst() -> None:
    # 24 device blocks, 8 host blocks: 12 prompts of 3 full blocks (36 hashes) evict at
    # least 12 from the device pool, so at least 4 from the host tier.
    proc, address = start_worker("--speedup-ratio", "0", "--kv-block-size", "32",
                                 "--num-gpu-blocks-override", "24", "--kv-host-cache-bytes",
                                 str(8 * BLOCK_BYTES), "--mock-kv-host-gbps", "0")
    index = PrefixIndex()
    watcher = WorkerWatcher(WorkerState(WorkerRef(address, address, "decode"), block_size=32,
                                        healthy=False), index)
    watcher.start()
    try:
        await burst(address, 0, 12)
        truth = await settled(watcher, lambda: tiers(address))
        worker = stats(address)
        assert worker.kv_offload_blocks >= 12
        assert len(truth[KvTier.HOST]) == worker.kv_host_blocks_used == 8
        assert index.blocks_of(address, KvTier.DEVICE) == truth[KvTier.DEVICE]
        assert index.blocks_of(address, KvTier.HOST) == truth[KvTier.HOST]
        # A prompt whose blocks went to the host tier, again: host hits, onboarded, and the
        # index follows. (Which prompts those are depends on the order the 12 were admitted.)
        cached = truth[KvTier.HOST] | truth[KvTier.DEVICE]
        in_host = [i for i in range(12) if set(prompt_hashes(i)) <= cached
                   and set(prompt_hashes(i)) & truth[KvTier.HOST]]
        assert in_host, "8 host blocks hold no whole prompt"
        await burst(address, in_host[0], 1)
        truth = await settled(watcher, lambda: tiers(address))
        assert stats(address).kv_onboard_blocks > 0
        assert index.blocks_of(address, KvTier.HOST) == truth[KvTier.HOST]
        assert index.blocks_of(address, KvTier.DEVICE) == truth[KvTier.DEVICE]
    finally:
        await watcher.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


async def test_a_cancel_during_an_onboard_leaks_nothing() -> None:
    proc, address = start_worker(*TIER_FLAGS, "--kv-host-cache-bytes", str(32 * BLOCK_BYTES),
                                 "--mock-kv-host-gbps", SLOW_GBPS)
    try:
        first = tokens(1)
        generate(address, "first", first, 40)
        generate(address, "filler", tokens(2), 40)  # evicts the first prompt to the host
        onboarded = stats(address).kv_onboard_blocks
        request = decode_pb2.GenerateRequest(
            request_id="again", token_ids=first,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=40))
        async with grpc.aio.insecure_channel(address) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Generate(request)
            while stats(address).kv_onboard_blocks == onboarded:  # the copy takes ~1 s
                await asyncio.sleep(0.01)
            call.cancel()
            assert call.cancelled()
        wait_idle(address)
        await host_tier_settles(address)
        out, last = generate(address, "after", first, 40)
        assert len(out) == 40 and last.usage.cached_tokens == 128
        wait_idle(address)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _complete(url: str, model: str, prompt: list[int], results: list[object],
              errors: list[BaseException]) -> None:
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        results.append(api.completions.create(model=model, prompt=prompt, max_tokens=40,
                                              temperature=0, extra_body={"ignore_eos": True}))
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_a_worker_killed_during_an_offload_leaks_nothing() -> None:
    topo = start_topology("--engine", "mock", *TIER_FLAGS, "--kv-host-cache-bytes",
                          str(32 * BLOCK_BYTES), "--mock-kv-host-gbps", SLOW_GBPS,
                          num_decode=2)
    try:
        # Two requests per worker (round robin): each second one waits for the first, then
        # evicts its blocks to the host tier, a copy of ~1 s.
        results: list = []
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_complete, args=(topo.http_url, topo.model,
                                                            tokens(10 + i), results, errors))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        victim: list[str] = []

        def offloading() -> bool:
            for address in topo.decode_addresses:
                worker: worker_pb2.StatsResponse = stats(address)
                if worker.kv_offload_blocks and worker.num_running:
                    victim.append(address)
                    return True
            return False

        wait_for(offloading, "no worker started an offload")
        port = int(victim[0].rsplit(":", 1)[1])
        os.kill(child_pid(topo.process.pid, port), signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        assert len(results) == 4
        for reply in results:
            assert reply.choices[0].finish_reason == "length"
            assert reply.usage.completion_tokens == 40
        survivor = next(a for a in topo.decode_addresses if a != victim[0])
        wait_idle(survivor)
        asyncio.run(host_tier_settles(survivor))
    finally:
        topo.stop()
