"""A loads-only KvEvents subscriber's reports (tandem.kv.subscription.subscribe_loads): prompt
while requests run, no polling while the worker is idle, the heartbeat, the drain."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from tandem.engines.types import EngineStats
from tandem.kv.subscription import HEARTBEAT_INTERVALS, subscribe_loads
from tandem.runtime.server import Draining

INTERVAL_S = 0.05
HEARTBEAT_S = HEARTBEAT_INTERVALS * INTERVAL_S


class Load:
    """An engine's stats() that counts how often it is read."""

    def __init__(self) -> None:
        self.stats = EngineStats(num_running=0, num_waiting=0, kv_blocks_used=0,
                                 kv_blocks_total=100, pending_prefill_tokens=0,
                                 active_decode_blocks=0, prefix_cache_hit_rate=0.0)
        self.num_reads = 0

    def __call__(self) -> EngineStats:
        self.num_reads += 1
        return self.stats

    def set_running(self, n: int) -> None:
        self.stats = dataclasses.replace(self.stats, num_running=n, kv_blocks_used=4 * n,
                                         active_decode_blocks=4 * n)


async def collect(reports: asyncio.Queue[tuple[float, EngineStats]], load: Load,
                  draining: Draining) -> None:
    async for stats in subscribe_loads(load, INTERVAL_S, draining):
        await reports.put((time.monotonic(), stats))


async def test_idle_worker_reports_only_the_heartbeat_and_reads_its_load_rarely() -> None:
    load, draining, reports = Load(), Draining(), asyncio.Queue()
    task = asyncio.create_task(collect(reports, load, draining))
    try:
        _, first = await reports.get()
        assert first == load.stats
        started, reads = time.monotonic(), load.num_reads
        at, beat = await asyncio.wait_for(reports.get(), 4 * HEARTBEAT_S)
        assert beat == first and at - started >= 0.8 * HEARTBEAT_S
        # Polled every interval it would have read the load ~HEARTBEAT_INTERVALS times.
        assert load.num_reads - reads <= 2
    finally:
        task.cancel()


async def test_a_request_is_reported_within_an_interval_or_two_then_its_end() -> None:
    load, draining, reports = Load(), Draining(), asyncio.Queue()
    task = asyncio.create_task(collect(reports, load, draining))
    try:
        await reports.get()
        await asyncio.sleep(HEARTBEAT_S / 4)  # idle for a while: the loop waits, not polls
        load.set_running(1)
        draining.enter()
        entered = time.monotonic()
        at, busy = await asyncio.wait_for(reports.get(), HEARTBEAT_S / 2)
        assert busy.num_running == 1 and at - entered < 4 * INTERVAL_S
        load.set_running(0)
        draining.leave()
        left = time.monotonic()
        at, idle = await asyncio.wait_for(reports.get(), HEARTBEAT_S / 2)
        assert idle.num_running == 0 and at - left < 4 * INTERVAL_S
    finally:
        task.cancel()


async def test_the_drain_ends_an_idle_subscription_at_once() -> None:
    load, draining, reports = Load(), Draining(), asyncio.Queue()
    task = asyncio.create_task(collect(reports, load, draining))
    await reports.get()
    await asyncio.sleep(INTERVAL_S)
    draining.begin()
    await asyncio.wait_for(task, HEARTBEAT_S / 4)
