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
    per interval (at once when the worker just went idle), and at least every
    HEARTBEAT_INTERVALS intervals."""

    def __init__(self, stats: Callable[[], EngineStats], interval_s: float) -> None:
        self.stats, self.interval_s = stats, interval_s
        self.sent = stats()
        self.sent_at = time.monotonic()

    def due(self, went_idle: bool = False) -> EngineStats | None:
        """The load to report now, or None. `went_idle`: the worker's last request just ended;
        a changed load goes out at once, interval or not (module docstring of `subscribe`)."""
        now = time.monotonic()
        early = now - self.sent_at < self.interval_s
        if early and not went_idle:
            return None
        load = self.stats()
        if load == self.sent and (early or
                                  now - self.sent_at < HEARTBEAT_INTERVALS * self.interval_s):
            return None
        self.sent, self.sent_at = load, now
        return load

    def idle_wait_s(self) -> float:
        """How long a subscription of an idle worker may sleep: until a change not reported
        yet may go out, else until the heartbeat."""
        intervals = 1 if self.stats() != self.sent else HEARTBEAT_INTERVALS
        return max(self.sent_at + intervals * self.interval_s - time.monotonic(), 0.0)


class Activity(Protocol):
    """What a subscription needs of its service (tandem.runtime.server.Draining)."""

    #: Requests in flight now.
    num_in_flight: int
    #: The service drains: subscriptions end.
    active: bool

    async def wait_for_work(self, timeout_s: float) -> None:
        """Returns once a request is in flight or the drain began, or after `timeout_s`."""

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight (now or within `timeout_s`)."""


async def _wait_for_events(log: EventLog, last: int, timeout_s: float,
                           activity: Activity) -> bool:
    """Waits for events beyond `last` (then True) or `timeout_s`; while requests are in
    flight, also for the last of them to end; while the service is idle, for a request or the
    drain (whichever comes first ends the wait)."""
    events = asyncio.ensure_future(log.wait_beyond(last))
    work = asyncio.ensure_future(activity.wait_idle(timeout_s) if activity.num_in_flight
                                 else activity.wait_for_work(timeout_s))
    try:
        await asyncio.wait((events, work), return_when=asyncio.FIRST_COMPLETED)
    finally:
        arrived = events.done() and not events.cancelled()
        events.cancel()
        work.cancel()
    return arrived


async def subscribe(log: EventLog, stats: Callable[[], EngineStats],
                    start_sequence: int | None, epoch: int | None, load_interval_s: float,
                    activity: Activity, batch_s: float = 0.0) -> AsyncIterator[Message]:
    """Yields the subscriber's messages until the service drains (`activity.active`).

    Events go out at most once per `batch_s`: once a step's events arrive, those of the steps
    that follow within `batch_s` join them in one message (every gRPC message costs a wake-up
    of both processes; an engine that steps every millisecond would otherwise send a message
    per step to every subscriber). A subscriber that keeps no prefix index takes
    `subscribe_loads` instead.

    Load (EngineStats) is sent once at the start, then when it changed, at most once per
    `load_interval_s`, and at least every HEARTBEAT_INTERVALS intervals even when unchanged, so
    that a subscriber's estimate built between reports never drifts for long. The one
    exception to the interval: when the worker's last request ends, a changed load goes out at
    once. Another frontend process that routes the next request knows only these reports; a
    report of a finished request's blocks, stale for up to an interval, would send that request
    away from the worker holding its prefix. That is one message per busy period, not per step.
    While no request is in flight the loop does not wake each interval to find nothing new: it
    waits for events, a request, the drain or the next report due (as `subscribe_loads` does).
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
    while not activity.active:
        busy = activity.num_in_flight > 0
        timeout_s = load_interval_s if busy else pacer.idle_wait_s()
        if await _wait_for_events(log, last, timeout_s, activity) and batch_s > 0:
            await asyncio.sleep(batch_s)
        if activity.active:
            return
        last, pending = _catch_up(log, last + 1)
        for message in pending:
            yield message
        load = pacer.due(went_idle=busy and not activity.num_in_flight)
        if load is not None:
            yield load


async def subscribe_loads(stats: Callable[[], EngineStats], interval_s: float,
                          activity: Activity) -> AsyncIterator[EngineStats]:
    """A loads-only subscriber's reports (one that keeps no prefix index: a frontend's local
    router over round-robin or least-loaded pools): the load at the start, then on a change at
    most once per `interval_s` while requests are in flight, and at least every
    HEARTBEAT_INTERVALS intervals, and at once when the last request ends (as `subscribe`),
    until the service drains.

    While no request is in flight the load hardly moves (a prefill worker's leases expire), so
    the loop sleeps until a request comes, the drain begins or the heartbeat is due, instead of
    waking every interval to find nothing new (each wake-up of an idle worker costs CPU)."""
    pacer = _LoadPacer(stats, interval_s)
    yield pacer.sent
    while not activity.active:
        went_idle = False
        if activity.num_in_flight:
            went_idle = await activity.wait_idle(interval_s) and not activity.num_in_flight
        else:
            await activity.wait_for_work(pacer.idle_wait_s())
            if activity.active:
                return
        # A request that came right after a report: sampled an interval later.
        load = pacer.due(went_idle)
        if load is not None:
            yield load
