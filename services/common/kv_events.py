"""KvEvents servicer: a worker's KV event log and load, streamed to routers."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from tandem.engines.base import Engine
from tandem.kv.event_log import EventLog
from tandem.runtime import convert
from tandem.runtime.server import Draining
from tandem.v1 import kv_events_pb2 as pb
from tandem.v1 import kv_events_pb2_grpc


class KvEventsServicer(kv_events_pb2_grpc.KvEventsServicer):
    def __init__(self, worker_id: str, engine: Engine, event_log: EventLog,
                 load_interval_ms: int, draining: Draining) -> None:
        self.draining = draining
        self.worker_id = worker_id
        self.engine = engine
        self.event_log = event_log
        self.load_interval_s = load_interval_ms / 1000

    def _load(self) -> pb.KvEventsMessage:
        load = convert.load_to_pb(self.worker_id, self.engine.stats(), int(time.time() * 1000))
        return pb.KvEventsMessage(load=load)

    def _resync(self) -> tuple[int, pb.KvEventsMessage]:
        sequence, blocks = self.event_log.snapshot()
        resync = pb.Resync(sequence=sequence, blocks=[convert.stored_to_pb(b) for b in blocks])
        return sequence, pb.KvEventsMessage(resync=resync)

    def _batches(self, start: int) -> tuple[int, list[pb.KvEventsMessage]]:
        """Messages for every batch from `start`, or a resync when they left the buffer."""
        batches = self.event_log.since(start)
        if batches is None:
            last, resync = self._resync()
            return last, [resync]
        messages = [pb.KvEventsMessage(batch=pb.KvEventBatch(
            sequence=seq, events=[convert.kv_event_to_pb(e) for e in events]))
            for seq, events in batches]
        return (batches[-1][0] if batches else start - 1), messages

    async def Subscribe(self, request: pb.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventsMessage]:
        if request.HasField("start_sequence"):
            last, messages = self._batches(max(request.start_sequence, 1))
        else:
            last, resync = self._resync()
            messages = [resync]
        for message in messages:
            yield message
        last_load = self._load()
        yield last_load
        # Subscriptions end when the worker drains, so they never hold its shutdown open.
        while not self.draining.active:
            try:
                await asyncio.wait_for(self.event_log.wait_beyond(last), self.load_interval_s)
            except asyncio.TimeoutError:
                pass  # no events this interval; still report load if it changed
            last, messages = self._batches(last + 1)
            for message in messages:
                yield message
            load = self._load()
            if load.load.SerializeToString() != last_load.load.SerializeToString():
                yield load
                last_load = load
