"""KvEvents servicer: a worker's KV event log and load, streamed to routers."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from tandem.engines.base import Engine
from tandem.engines.types import EngineStats
from tandem.kv.event_log import EventLog
from tandem.kv.subscription import Batch, Message, Resync, subscribe, subscribe_loads
from tandem.runtime import convert
from tandem.runtime.devices import Device
from tandem.runtime.draining import Draining
from tandem.runtime.served import ServedStats
from tandem.v1 import kv_events_pb2 as pb
from tandem.v1 import kv_events_pb2_grpc

#: Converted batches kept for the next subscriber (a few steps' worth).
_CONVERTED_KEPT = 16


class KvEventsServicer(kv_events_pb2_grpc.KvEventsServicer):
    def __init__(self, worker_id: str, engine: Engine, event_log: EventLog,
                 load_interval_ms: int, draining: Draining, batch_ms: float = 0.0,
                 served: Callable[[], ServedStats] | None = None,
                 devices: Sequence[Device] = ()) -> None:
        self.worker_id = worker_id
        #: What each load report adds: what the worker served, as of the report, and its
        #: devices (converted once: they do not change).
        self.served = served
        self._devices = convert.devices_to_pb(devices)
        self.engine = engine
        self.event_log = event_log
        self.load_interval_s = load_interval_ms / 1000
        self.batch_s = batch_ms / 1000
        self.draining = draining
        #: The last batches converted, by (epoch, first sequence, sequence): subscribers woken
        #: by the same step mostly take the same steps in one message (the router service and
        #: each frontend's local router follow every worker), so each is converted once.
        self._converted: OrderedDict[tuple[int, int | None, int], pb.KvEventsMessage] = \
            OrderedDict()

    def _to_pb(self, message: Message) -> pb.KvEventsMessage:
        epoch = self.event_log.epoch
        if isinstance(message, Batch):
            key = (epoch, message.first_sequence, message.sequence)
            converted = self._converted.get(key)
            if converted is None:
                converted = self._converted[key] = self._batch_to_pb(message, epoch)
                if len(self._converted) > _CONVERTED_KEPT:
                    self._converted.popitem(last=False)
            return converted
        if isinstance(message, Resync):
            return pb.KvEventsMessage(resync=pb.Resync(
                sequence=message.sequence, epoch=epoch,
                blocks=[convert.stored_to_pb(b) for b in message.blocks]))
        assert isinstance(message, EngineStats)
        served = self.served() if self.served is not None else None
        return pb.KvEventsMessage(load=convert.load_to_pb(
            self.worker_id, message, int(time.time() * 1000), served, self._devices))

    @staticmethod
    def _batch_to_pb(message: Batch, epoch: int) -> pb.KvEventsMessage:
        batch = pb.KvEventBatch(sequence=message.sequence, epoch=epoch,
                                events=[convert.kv_event_to_pb(e) for e in message.events])
        if message.first_sequence is not None:
            batch.first_sequence = message.first_sequence
        return pb.KvEventsMessage(batch=batch)

    async def Subscribe(self, request: pb.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventsMessage]:
        if request.loads_only:
            async for load in subscribe_loads(self.engine.stats, self.load_interval_s,
                                              self.draining):
                yield self._to_pb(load)
            return
        start = request.start_sequence if request.HasField("start_sequence") else None
        epoch = request.epoch if request.HasField("epoch") else None
        # Subscriptions end when the worker drains, so they never hold its shutdown open.
        async for message in subscribe(self.event_log, self.engine.stats, start, epoch,
                                       self.load_interval_s, self.draining, self.batch_s):
            yield self._to_pb(message)

