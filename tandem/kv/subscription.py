"""One subscriber's view of a worker's KV event log: replay from a sequence number, a resync
snapshot when replay is impossible, then live batches and load reports.

The KvEvents servicer only converts what this yields to protobuf.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tandem.engines.types import BlockStored, EngineStats, KvEvent
from tandem.kv.event_log import EventLog


@dataclass(frozen=True, slots=True)
class Batch:
    sequence: int
    events: tuple[KvEvent, ...]


@dataclass(frozen=True, slots=True)
class Resync:
    """Forget what you know of this worker: this is its whole cache as of `sequence`."""

    sequence: int
    blocks: list[BlockStored]


Message = Batch | Resync | EngineStats
#: An unchanged load is re-sent after this many load intervals (1 s at the default 100 ms).
HEARTBEAT_INTERVALS = 10


def _resync(log: EventLog) -> tuple[int, Resync]:
    sequence, blocks = log.snapshot()
    return sequence, Resync(sequence, blocks)


def _catch_up(log: EventLog, start: int) -> tuple[int, list[Message]]:
    """Batches from `start` on (last sequence, messages), or a resync when replay cannot give
    exactly what follows `start - 1`."""
    batches = None if start > log.last_sequence + 1 else log.since(start)
    if batches is None:
        last, resync = _resync(log)
        return last, [resync]
    messages: list[Message] = [Batch(seq, events) for seq, events in batches]
    return (batches[-1][0] if batches else start - 1), messages


async def subscribe(log: EventLog, stats: Callable[[], EngineStats],
                    start_sequence: int | None, epoch: int | None, load_interval_s: float,
                    is_closing: Callable[[], bool]) -> AsyncIterator[Message]:
    """Yields the subscriber's messages until `is_closing()` (checked each load interval).

    Load (EngineStats) is sent once at the start, then when it changed, at most once per
    `load_interval_s`, and at least every HEARTBEAT_INTERVALS intervals even when unchanged, so
    that a subscriber's estimate built between reports never drifts for long.
    """
    if start_sequence is None or (epoch is not None and epoch != log.epoch):
        last, first = _resync(log)
        pending: list[Message] = [first]
    else:
        last, pending = _catch_up(log, max(start_sequence, 1))
    for message in pending:
        yield message
    sent_load = stats()
    sent_at = time.monotonic()
    yield sent_load
    while not is_closing():
        try:
            await asyncio.wait_for(log.wait_beyond(last), load_interval_s)
        except asyncio.TimeoutError:
            pass  # no events this interval; the load may still have changed
        last, pending = _catch_up(log, last + 1)
        for message in pending:
            yield message
        now = time.monotonic()
        if now - sent_at >= load_interval_s:
            load = stats()
            if load != sent_load or now - sent_at >= HEARTBEAT_INTERVALS * load_interval_s:
                sent_load, sent_at = load, now
                yield load
