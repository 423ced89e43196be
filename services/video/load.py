"""The KvEvents stream of a video worker: no KV events (it has no KV cache), only its load
(running and queued jobs), so that the router follows it like any worker and its least-loaded
policy sees the queues."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from tandem.engines.types import EngineStats
from tandem.kv.event_log import EventLog
from tandem.kv.subscription import subscribe
from tandem.runtime import convert
from tandem.runtime.draining import Draining
from tandem.v1 import kv_events_pb2 as pb
from tandem.v1 import kv_events_pb2_grpc
from tandem.video.runner import VideoRunner


class VideoLoadServicer(kv_events_pb2_grpc.KvEventsServicer):
    def __init__(self, worker_id: str, runner: VideoRunner, load_interval_ms: int,
                 draining: Draining) -> None:
        self.worker_id = worker_id
        self.runner = runner
        self.load_interval_s = load_interval_ms / 1000
        self.draining = draining
        #: Stays empty: resyncs answer "no blocks".
        self.event_log = EventLog(1)

    async def Subscribe(self, request: pb.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventsMessage]:
        start = request.start_sequence if request.HasField("start_sequence") else None
        epoch = request.epoch if request.HasField("epoch") else None
        async for message in subscribe(self.event_log, self.runner.stats, start, epoch,
                                       self.load_interval_s, self.draining):
            if isinstance(message, EngineStats):
                yield pb.KvEventsMessage(load=convert.load_to_pb(
                    self.worker_id, message, int(time.time() * 1000)))
            else:  # a resync of the empty log (a subscriber from another epoch)
                yield pb.KvEventsMessage(resync=pb.Resync(sequence=message.sequence,
                                                          epoch=self.event_log.epoch))
