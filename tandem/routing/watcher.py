"""Follows one worker for the router: its health (grpc.health.v1 Watch) and its KvEvents stream
(prefix index updates and load reports). The worker is a routing candidate only while both say
so; it leaves the candidate set when either breaks and comes back when both recover.

The event stream is resumed from the last sequence number and epoch seen, so a reconnect misses
nothing; a worker that restarted (new epoch) or a gap the worker cannot replay arrives as a
Resync, which replaces the worker's entry in the index.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.routing.prefix_index import PrefixIndex
from tandem.routing.workers import Health, WorkerState
from tandem.runtime import convert
from tandem.runtime.router_status import load_from_pb
from tandem.runtime.tls import TlsConfig, aio_channel
from tandem.v1 import kv_events_pb2 as pb
from tandem.v1 import kv_events_pb2_grpc

log = logging.getLogger(__name__)
RECONNECT_S = (0.2, 0.5, 1.0, 2.0)
KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
             ("grpc.keepalive_permit_without_calls", 1),
             # gRPC's own reconnect back-off (1 s growing to 120 s) would keep a worker that
             # came up late out of the candidate set long after it serves: cap it near ours.
             ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
             ("grpc.max_reconnect_backoff_ms", 2_000)]


class SequenceGap(Exception):
    """A batch did not follow the last one; the stream is re-subscribed from the last seen."""


class WorkerWatcher:
    def __init__(self, state: WorkerState, index: PrefixIndex,
                 on_change: Callable[[], None] = lambda: None,
                 tls: TlsConfig | None = None, loads_only: bool = False) -> None:
        self.state = state
        self.index = index
        #: Ask the worker for its load reports only (no KV events: nothing goes in the index).
        self.loads_only = loads_only
        self.on_change = on_change
        # Keepalive pings detect a peer that vanished without closing the connection (a lost
        # node): both streams are otherwise silent while nothing changes.
        self.channel = aio_channel(state.ref.address, tls, KEEPALIVE)
        self.epoch: int | None = None
        self.last_sequence: int | None = None
        #: Whether the event stream ever delivered, and whether its current outage was logged.
        self._events_seen = False
        self._events_outage_logged = False
        #: Set whenever the worker's candidacy or index changes (tests and metrics wait on it).
        self.changed = asyncio.Event()
        #: Whether the worker's index entry is as rebuilt as it can be now (see `is_settled`).
        self._was_settled = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow_health()),
                       asyncio.create_task(self._follow_events())]
        self._update()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.channel.close()

    @property
    def is_settled(self) -> bool:
        """Whether the router has what it can have of this worker: its event stream delivered
        (the first message replays the worker's whole cache into the index, or is its first
        load report when `loads_only`), or the worker cannot deliver now (unreachable, or not
        serving: starting or draining)."""
        return self._events_seen or self.state.health in (Health.UNREACHABLE,
                                                          Health.NOT_SERVING)

    def _update(self) -> None:
        settled = self.is_settled and not self._was_settled
        self._was_settled |= settled
        if self.state.refresh_candidacy():
            log.info("worker candidacy changed", extra={"worker": self.state.worker_id,
                                                        "healthy": self.state.healthy})
            self.on_change()
        elif settled:
            self.on_change()
        self.changed.set()

    async def _retry(self, attempt: int) -> None:
        await asyncio.sleep(RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)])

    async def _follow_health(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        attempt = 0
        while True:
            try:
                async for reply in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    self.state.health = (
                        Health.SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING
                        else Health.NOT_SERVING)
                    self.state.health_error = ""
                    attempt = 0
                    self._update()
                self.state.health_error = "health stream ended"
            except grpc.aio.AioRpcError as exc:
                self.state.health_error = _error(exc)
            except Exception as exc:  # never let the watch die: the worker would stay a candidate
                log.exception("health watch failed", extra={"worker": self.state.worker_id})
                self.state.health_error = repr(exc)
            self.state.health = Health.UNREACHABLE
            self._update()
            await self._retry(attempt)
            attempt += 1

    def _request(self) -> pb.SubscribeRequest:
        request = pb.SubscribeRequest(loads_only=self.loads_only)
        if self.last_sequence is not None:
            request.start_sequence = self.last_sequence + 1
            if self.epoch is not None:
                request.epoch = self.epoch
        return request

    async def _follow_events(self) -> None:
        stub = kv_events_pb2_grpc.KvEventsStub(self.channel)
        attempt = 0
        while True:
            try:
                async for message in stub.Subscribe(self._request()):
                    self._on_message(message)
                    attempt = 0
                self.state.events_error = "event stream ended"
            except (grpc.aio.AioRpcError, SequenceGap) as exc:
                self.state.events_error = (_error(exc) if isinstance(exc, grpc.aio.AioRpcError)
                                           else str(exc))
                self._note_events_down()
            except Exception as exc:  # a bad message: start over from a snapshot, not stop
                log.exception("event stream failed", extra={"worker": self.state.worker_id})
                self.last_sequence = self.epoch = None
                self.state.events_error = repr(exc)
            self.state.events_connected = False
            self._update()
            await self._retry(attempt)
            attempt += 1

    def _on_message(self, message: pb.KvEventsMessage) -> None:
        kind = message.WhichOneof("payload")
        worker = self.state.worker_id
        if kind == "resync":
            resync = message.resync
            self.index.reset(worker, [convert.stored_from_pb(b) for b in resync.blocks])
            self.epoch, self.last_sequence = resync.epoch, resync.sequence
        elif kind == "batch":
            batch = message.batch
            expected = None if self.last_sequence is None else self.last_sequence + 1
            first = batch.first_sequence if batch.HasField("first_sequence") else batch.sequence
            if expected is not None and first != expected:
                # A worker resyncs rather than skip; if one ever skips, resubscribe from the gap.
                raise SequenceGap(f"{worker}: expected {expected}, got {first}")
            self.index.apply(worker, [convert.kv_event_from_pb(e) for e in batch.events])
            self.epoch, self.last_sequence = batch.epoch, batch.sequence
        else:
            self.state.take_report(load_from_pb(message.load), time.monotonic())
        if self._events_outage_logged:
            log.log(logging.INFO if self._events_seen else logging.DEBUG, "event stream open",
                    extra={"worker": self.state.worker_id})
            self._events_outage_logged = False
        self._events_seen = True
        self.state.events_connected, self.state.events_error = True, ""
        self._update()

    def _note_events_down(self) -> None:
        """One line per outage, not one per reconnect attempt: a worker whose stream never
        opened is still starting (expected while `tandem up` loads models: debug); one that
        had it open lost it (warning)."""
        if self._events_outage_logged:
            return
        self._events_outage_logged = True
        extra = {"worker": self.state.worker_id, "error": self.state.events_error}
        if self._events_seen:
            log.warning("event stream broke; reconnecting", extra=extra)
        else:
            log.debug("waiting for the worker's event stream", extra=extra)


def _error(exc: grpc.aio.AioRpcError) -> str:
    """A broken stream's cause in one line, for operators."""
    return f"{exc.code().name}: {exc.details()}"
