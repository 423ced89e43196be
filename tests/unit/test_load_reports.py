"""A KvEvents subscriber's load reports, loads-only (tandem.kv.subscription.subscribe_loads)
and with events (subscribe): prompt while requests run, no polling while the worker is idle, the
heartbeat, the drain; a worker that goes idle says so at once; events reach an idle subscription
at once."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tandem.engines.types import BlockStored, EngineStats
from tandem.kv.event_log import EventLog
from tandem.kv.subscription import HEARTBEAT_INTERVALS, Batch, subscribe, subscribe_loads
from tandem.runtime.draining import Draining

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
                  draining: Draining, kind: str = "loads", log: EventLog | None = None,
                  interval_s: float = INTERVAL_S) -> None:
    """Puts (arrival, report) for each load report of a `kind` subscription ("loads": loads
    only; "events": with the KV events of `log`, which go into the queue as they are)."""
    if kind == "loads":
        async for stats in subscribe_loads(load, interval_s, draining):
            await reports.put((time.monotonic(), stats))
        return
    async for message in subscribe(log or EventLog(100), load, 1, None, interval_s, draining):
        await reports.put((time.monotonic(), message))  # type: ignore[arg-type]


KINDS = pytest.mark.parametrize("kind", ["loads", "events"])


@KINDS
async def test_idle_worker_reports_only_the_heartbeat_and_reads_its_load_rarely(kind: str) -> None:
    load, draining, reports = Load(), Draining(), asyncio.Queue()
    task = asyncio.create_task(collect(reports, load, draining, kind))
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


@KINDS
async def test_a_request_is_reported_within_an_interval_or_two_then_its_end(kind: str) -> None:
    load, draining, reports = Load(), Draining(), asyncio.Queue()
    task = asyncio.create_task(collect(reports, load, draining, kind))
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


@KINDS
async def test_the_end_of_the_last_request_is_reported_at_once(kind: str) -> None:
    """Not an interval after the report of its start: another frontend process would route
    the next request on the stale load (kv/subscription.py, `subscribe`)."""
    interval_s = 1.0
    load, draining, reports = Load(), Draining(), asyncio.Queue()
    task = asyncio.create_task(collect(reports, load, draining, kind, interval_s=interval_s))
    try:
        await reports.get()
        await asyncio.sleep(interval_s)  # the start's report may go at once
        load.set_running(1)
        draining.enter()
        _, busy = await asyncio.wait_for(reports.get(), interval_s)
        assert busy.num_running == 1
        load.set_running(0)
        draining.leave()
        left = time.monotonic()
        at, idle = await asyncio.wait_for(reports.get(), 2 * interval_s)
        assert idle.num_running == 0 and at - left < interval_s / 2
    finally:
        task.cancel()


@KINDS
async def test_the_drain_ends_an_idle_subscription_at_once(kind: str) -> None:
    load, draining, reports = Load(), Draining(), asyncio.Queue()
    task = asyncio.create_task(collect(reports, load, draining, kind))
    await reports.get()
    await asyncio.sleep(INTERVAL_S)
    draining.begin()
    await asyncio.wait_for(task, HEARTBEAT_S / 4)


async def test_events_reach_an_idle_subscription_at_once() -> None:
    load, draining, reports, log = Load(), Draining(), asyncio.Queue(), EventLog(100)
    task = asyncio.create_task(collect(reports, load, draining, "events", log))
    try:
        await reports.get()
        await asyncio.sleep(HEARTBEAT_S / 4)  # idle: the loop waits for events, not polls
        stored = BlockStored((7,), None, (1, 2), 2)
        log.append([stored])
        appended = time.monotonic()
        at, batch = await asyncio.wait_for(reports.get(), HEARTBEAT_S / 2)
        assert batch == Batch(1, (stored,)) and at - appended < INTERVAL_S
    finally:
        task.cancel()
