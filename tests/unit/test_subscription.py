"""A subscriber's view of the KV event log: replay, resync cases, and load only on change."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from tandem.engines.types import BlockRemoved, BlockStored, EngineStats
from tandem.kv.event_log import EventLog
from tandem.kv.subscription import Batch, Resync, subscribe, subscribe_loads
from tandem.runtime.draining import Draining

IDLE = EngineStats(0, 0, 0, 64, 0, 0, 0.0)


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored((h,), parent, (1, 2), 2)


def filled_log(capacity: int = 100) -> EventLog:
    log = EventLog(capacity)
    log.append([stored(1)])
    log.append([stored(2, 1)])
    log.append([BlockRemoved((2,))])
    return log


async def take(n: int, log: EventLog, start: int | None, epoch: int | None = None,
               stats=lambda: IDLE, interval: float = 0.01) -> list:
    out: list = []
    async for message in subscribe(log, stats, start, epoch, interval, Draining()):
        out.append(message)
        if len(out) == n:
            break
    return out


async def test_replay_from_a_sequence_then_load() -> None:
    # What a reconnecting subscriber missed comes as one message spanning the batches.
    log = filled_log()
    messages = await take(2, log, start=2, epoch=log.epoch)
    assert messages == [Batch(3, (stored(2, 1), BlockRemoved((2,))), first_sequence=2), IDLE]


async def test_no_start_means_snapshot() -> None:
    log = filled_log()
    first, load = await take(2, log, start=None)
    assert first == Resync(3, [stored(1)]) and load == IDLE


async def test_sequence_older_than_the_buffer_resyncs() -> None:
    log = filled_log(capacity=1)
    (first,) = await take(1, log, start=1, epoch=log.epoch)
    assert isinstance(first, Resync) and first.sequence == 3


async def test_sequence_beyond_the_log_resyncs() -> None:
    # A subscriber that saw more than this log has (the worker restarted) must not wait silently.
    log = filled_log()
    (first,) = await take(1, log, start=5000)
    assert isinstance(first, Resync) and first.sequence == 3


async def test_other_epoch_resyncs() -> None:
    log = filled_log()
    (first,) = await take(1, log, start=2, epoch=log.epoch + 1)
    assert isinstance(first, Resync)


async def test_live_batches_follow_and_load_only_when_it_changes() -> None:
    log = filled_log()
    current = [IDLE]
    received: list = []

    async def consume() -> None:
        async for message in subscribe(log, lambda: current[0], 4, log.epoch, 0.01,
                                       Draining()):
            received.append(message)
            if isinstance(message, EngineStats) and message.num_running == 1:
                break

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)  # several load intervals with an unchanged load
    assert received == [IDLE]
    log.append([stored(7)])
    current[0] = replace(IDLE, num_running=1)
    await asyncio.wait_for(task, 5)
    assert received == [IDLE, Batch(4, (stored(7),)), replace(IDLE, num_running=1)]


async def test_steps_within_the_batch_time_go_out_in_one_message() -> None:
    log = filled_log()
    received: list = []

    async def consume() -> None:
        async for message in subscribe(log, lambda: IDLE, 4, log.epoch, 10.0, Draining(),
                                       batch_s=0.05):
            received.append(message)
            if isinstance(message, Batch):
                break

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    log.append([stored(7)])
    await asyncio.sleep(0.01)  # within batch_s of the first: joins it
    log.append([BlockRemoved((7,))])
    await asyncio.wait_for(task, 5)
    assert received == [IDLE, Batch(5, (stored(7), BlockRemoved((7,))), first_sequence=4)]


async def test_loads_only_sends_no_event() -> None:
    # A subscriber that keeps no prefix index (a frontend's local router over round-robin
    # pools): its worker's steps reach it only as load.
    log = filled_log()
    current = [IDLE]
    received: list = []
    activity = Draining()
    activity.enter()  # a request in flight: reports are due each interval

    async def consume() -> None:
        async for message in subscribe_loads(lambda: current[0], 0.01, activity):
            received.append(message)
            if message.num_running == 1:
                break

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.03)
    log.append([stored(7)])
    current[0] = replace(IDLE, num_running=1)
    await asyncio.wait_for(task, 5)
    assert received[0] == IDLE and received[-1].num_running == 1
    assert all(isinstance(m, EngineStats) for m in received)
