"""One subscriber's view of a worker's KV event log: replay from a sequence number, a resync
snapshot when replay is impossible, then live batches and load reports.

The KvEvents servicer only converts what this yields to protobuf.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from tandem.engines.types import BlockStored, EngineStats, KvEvent
from tandem.kv.event_log import EventLog


@dataclass(frozen=True, slots=True)
class Batch:
    """The events of the log's batches `first_sequence`..`sequence`, in order."""

    sequence: int
    events: tuple[KvEvent, ...]
    #: None: the one batch `sequence`.
    first_sequence: int | None = None


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
    """The batches from `start` on as one message (last sequence, messages), or a resync when
    replay cannot give exactly what follows `start - 1`."""
    batches = None if start > log.last_sequence + 1 else log.since(start)
    if batches is None:
        last, resync = _resync(log)
        return last, [resync]
    if not batches:
        return start - 1, []
    last = batches[-1][0]
    if len(batches) == 1:
        return last, [Batch(last, batches[0][1])]
    events = tuple(e for _, step in batches for e in step)
    return last, [Batch(last, events, batches[0][0])]


class _LoadPacer:
    """When a subscriber's next load report is due: at the start, then on a change at most once
    per interval, and at least every HEARTBEAT_INTERVALS intervals."""

    def __init__(self, stats: Callable[[], EngineStats], interval_s: float) -> None:
        self.stats, self.interval_s = stats, interval_s
        self.sent = stats()
        self.sent_at = time.monotonic()

    def due(self) -> EngineStats | None:
        now = time.monotonic()
        if now - self.sent_at < self.interval_s:
            return None
        load = self.stats()
        if load == self.sent and now - self.sent_at < HEARTBEAT_INTERVALS * self.interval_s:
            return None
        self.sent, self.sent_at = load, now
        return load


async def subscribe(log: EventLog, stats: Callable[[], EngineStats],
                    start_sequence: int | None, epoch: int | None, load_interval_s: float,
                    is_closing: Callable[[], bool], batch_s: float = 0.0,
                    ) -> AsyncIterator[Message]:
    """Yields the subscriber's messages until `is_closing()` (checked each load interval).

    Events go out at most once per `batch_s`: once a step's events arrive, those of the steps
    that follow within `batch_s` join them in one message (every gRPC message costs a wake-up
    of both processes; an engine that steps every millisecond would otherwise send a message
    per step to every subscriber). A subscriber that keeps no prefix index takes
    `subscribe_loads` instead.

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
    pacer = _LoadPacer(stats, load_interval_s)
    yield pacer.sent
    while not is_closing():
        try:
            await asyncio.wait_for(log.wait_beyond(last), load_interval_s)
        except asyncio.TimeoutError:
            pass  # no events this interval; the load may still have changed
        else:
            if batch_s > 0:
                await asyncio.sleep(batch_s)
        last, pending = _catch_up(log, last + 1)
        for message in pending:
            yield message
        load = pacer.due()
        if load is not None:
            yield load


class Activity(Protocol):
    """What a loads-only subscription needs of its service (tandem.runtime.server.Draining)."""

    #: Requests in flight now.
    num_in_flight: int
    #: The service drains: subscriptions end.
    active: bool

    async def wait_for_work(self, timeout_s: float) -> None:
        """Returns once a request is in flight or the drain began, or after `timeout_s`."""


async def subscribe_loads(stats: Callable[[], EngineStats], interval_s: float,
                          activity: Activity) -> AsyncIterator[EngineStats]:
    """A loads-only subscriber's reports (one that keeps no prefix index: a frontend's local
    router over round-robin or least-loaded pools): the load at the start, then on a change at
    most once per `interval_s` while requests are in flight, and at least every
    HEARTBEAT_INTERVALS intervals, until the service drains.

    While no request is in flight the load hardly moves (a prefill worker's leases expire), so
    the loop sleeps until a request comes, the drain begins or the heartbeat is due, instead of
    waking every interval to find nothing new (each wake-up of an idle worker costs CPU)."""
    pacer = _LoadPacer(stats, interval_s)
    yield pacer.sent
    heartbeat_s = HEARTBEAT_INTERVALS * interval_s
    while not activity.active:
        if activity.num_in_flight:
            await asyncio.sleep(interval_s)
        else:
            await activity.wait_for_work(max(pacer.sent_at + heartbeat_s - time.monotonic(), 0.0))
            if activity.active:
                return
        load = pacer.due()  # a request that came right after a report: sampled an interval later
        if load is not None:
            yield load
