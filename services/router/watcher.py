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
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.routing.prefix_index import PrefixIndex
from tandem.routing.workers import WorkerState
from tandem.runtime import convert
from tandem.runtime.tls import TlsConfig, aio_channel
from tandem.v1 import kv_events_pb2 as pb
from tandem.v1 import kv_events_pb2_grpc

log = logging.getLogger(__name__)
RECONNECT_S = (0.2, 0.5, 1.0, 2.0)
KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
             ("grpc.keepalive_permit_without_calls", 1)]


class SequenceGap(Exception):
    """A batch did not follow the last one; the stream is re-subscribed from the last seen."""


class WorkerWatcher:
    def __init__(self, state: WorkerState, index: PrefixIndex,
                 on_change: Callable[[], None] = lambda: None,
                 tls: TlsConfig | None = None) -> None:
        self.state = state
        self.index = index
        self.on_change = on_change
        # Keepalive pings detect a peer that vanished without closing the connection (a lost
        # node): both streams are otherwise silent while nothing changes.
        self.channel = aio_channel(state.ref.address, tls, KEEPALIVE)
        self.serving = False
        self.streaming = False
        self.epoch: int | None = None
        self.last_sequence: int | None = None
        #: Set whenever the worker's candidacy or index changes (tests and metrics wait on it).
        self.changed = asyncio.Event()
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

    def _update(self) -> None:
        healthy = self.serving and self.streaming
        if healthy != self.state.healthy:
            log.info("worker candidacy changed", extra={"worker": self.state.worker_id,
                                                        "healthy": healthy})
            self.state.healthy = healthy
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
                    self.serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    attempt = 0
                    self._update()
            except grpc.aio.AioRpcError:
                pass
            except Exception:  # never let the watch die: the worker would stay a candidate
                log.exception("health watch failed", extra={"worker": self.state.worker_id})
            self.serving = False
            self._update()
            await self._retry(attempt)
            attempt += 1

    def _request(self) -> pb.SubscribeRequest:
        request = pb.SubscribeRequest()
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
            except (grpc.aio.AioRpcError, SequenceGap) as exc:
                log.info("event stream broke", extra={"worker": self.state.worker_id,
                                                      "error": str(exc)})
            except Exception:  # a bad message: start over from a snapshot rather than stop
                log.exception("event stream failed", extra={"worker": self.state.worker_id})
                self.last_sequence = self.epoch = None
            self.streaming = False
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
            if expected is not None and batch.sequence != expected:
                # A worker resyncs rather than skip; if one ever skips, resubscribe from the gap.
                raise SequenceGap(f"{worker}: expected {expected}, got {batch.sequence}")
            self.index.apply(worker, [convert.kv_event_from_pb(e) for e in batch.events])
            self.epoch, self.last_sequence = batch.epoch, batch.sequence
        else:
            load = message.load
            bs = self.state.block_size
            self.state.report(-(-load.pending_prefill_tokens // bs), load.active_decode_blocks,
                              load.num_running + load.num_waiting)
        if not self.streaming:
            self.streaming = True
        self._update()
