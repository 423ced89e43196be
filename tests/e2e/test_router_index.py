"""The router's prefix index stays equal to what a worker really caches: after a burst with
evictions, after the router restarts (a fresh index) and after the worker restarts (a new
epoch). The router's real watcher runs in-process against real worker processes."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from tandem.routing.prefix_index import PrefixIndex
from tandem.routing.watcher import WorkerWatcher
from tandem.routing.workers import WorkerRef, WorkerState
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc
from tests.e2e.topology import start_worker

T = TypeVar("T")
WORKER_FLAGS = ("--speedup-ratio", "0", "--kv-block-size", "32", "--num-gpu-blocks-override",
                "24")


async def burst(address: str, first: int, count: int) -> None:
    """`count` distinct 100-token prompts: 3 full blocks each, so a 24-block pool evicts."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)

        async def one(i: int) -> None:
            request = decode_pb2.GenerateRequest(
                request_id=f"b{i}", token_ids=[(i * 131 + j) % 3000 + 10 for j in range(100)],
                sampling=common_pb2.SamplingParams(max_tokens=20, ignore_eos=True))
            async for _ in stub.Generate(request):
                pass

        await asyncio.gather(*(one(i) for i in range(first, first + count)))


async def truth(address: str) -> tuple[int, set[int]]:
    """The worker's own view: a fresh subscription's snapshot (sequence, cached blocks)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = kv_events_pb2_grpc.KvEventsStub(channel).Subscribe(kv_events_pb2.SubscribeRequest())
        first = await call.read()
        call.cancel()
    resync = first.resync
    return resync.sequence, {h for block in resync.blocks for h in block.block_hashes}


async def caught_up(watcher: WorkerWatcher, sequence: int) -> None:
    while watcher.last_sequence is None or watcher.last_sequence < sequence:
        watcher.changed.clear()
        await asyncio.wait_for(watcher.changed.wait(), 10)


async def settled(watcher: WorkerWatcher, fetch: Callable[[], Awaitable[tuple[int, T]]]) -> T:
    """The worker's own view (`fetch`: its snapshot and the sequence it reflects) once the
    watcher has exactly that sequence: a worker sends several steps' events in one message, so
    the watcher can pass a snapshot taken while the worker still wrote events; then take a
    newer one."""
    while True:
        sequence, view = await fetch()
        await caught_up(watcher, sequence)
        if watcher.last_sequence == sequence:
            return view


async def assert_index_matches(watcher: WorkerWatcher, index: PrefixIndex, address: str) -> None:
    blocks = await settled(watcher, lambda: truth(address))
    assert index.blocks_of(address) == blocks


async def until(watcher: WorkerWatcher, healthy: bool) -> None:
    while watcher.state.healthy is not healthy:
        watcher.changed.clear()
        await asyncio.wait_for(watcher.changed.wait(), 20)


def new_watcher(address: str) -> tuple[WorkerWatcher, PrefixIndex]:
    index = PrefixIndex()
    state = WorkerState(WorkerRef(address, address, "decode"), block_size=32, healthy=False)
    watcher = WorkerWatcher(state, index)
    watcher.start()
    return watcher, index


async def test_index_follows_evictions_and_both_restarts() -> None:
    proc, address = start_worker(*WORKER_FLAGS)
    port = int(address.rsplit(":", 1)[1])
    watcher, index = new_watcher(address)
    try:
        await until(watcher, True)
        await burst(address, 0, 12)  # 36 blocks of prompts into 24: evictions
        await assert_index_matches(watcher, index, address)
        assert index.blocks_of(address)

        # Router restart: a fresh index learns everything from the worker's snapshot.
        await watcher.close()
        watcher, index = new_watcher(address)
        await assert_index_matches(watcher, index, address)
        await burst(address, 12, 6)
        await assert_index_matches(watcher, index, address)

        # Worker restart (kill -9): the worker leaves the candidate set, comes back with a new
        # epoch, and its old blocks leave the index.
        old_epoch = watcher.epoch
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        await until(watcher, False)
        proc, _ = start_worker(*WORKER_FLAGS, port=port)
        await until(watcher, True)
        await assert_index_matches(watcher, index, address)
        assert watcher.epoch != old_epoch
        assert index.blocks_of(address) == set()  # the new worker caches nothing yet
        await burst(address, 100, 5)
        await assert_index_matches(watcher, index, address)
        assert index.blocks_of(address)
    finally:
        await watcher.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


async def test_dns_pool_resolves_to_workers_that_become_candidates() -> None:
    from tandem.routing.config import PoolConfig
    from tandem.routing.membership import Membership
    from tandem.routing.router import Router, RouteRequestInfo
    from tandem.routing.workers import SlaHints

    proc, address = start_worker(*WORKER_FLAGS)
    port = address.rsplit(":", 1)[1]
    pool = PoolConfig(name="decode", kind="decode", dns=f"localhost:{port}")
    router = Router([pool], None, 32, 1024)
    became_healthy = asyncio.Event()

    def on_change() -> None:
        if any(w.healthy for w in router.all_workers()):
            became_healthy.set()

    membership = Membership(router, refresh_s=60, on_change=on_change)
    tasks = membership.start([pool])
    try:
        await asyncio.wait_for(became_healthy.wait(), 20)
        assert address in {w.worker_id for w in router.all_workers()}
        decision = router.route(RouteRequestInfo("d", [1, 2, 3], (), 3, 8, SlaHints()))
        assert decision.decode_workers[0].worker_id == address
    finally:
        for task in tasks:
            task.cancel()
        await membership.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
