"""Worker servicer: the engine's stats snapshot and what the worker served, protobuf out; the
PauseWhen test hook."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from tandem.engines.base import Engine
from tandem.errors import FailedPrecondition, InvalidRequest
from tandem.runtime import convert
from tandem.runtime.devices import Device
from tandem.runtime.served import ServedStats
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, engine: Engine, debug_hooks: bool = False,
                 served: Callable[[], ServedStats] = ServedStats,
                 devices: Sequence[Device] = ()) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.debug_hooks = debug_hooks
        self.served = served
        self.devices = tuple(devices)

    async def Stats(self, request: pb.StatsRequest,
                    context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = dataclasses.asdict(self.engine.stats())
        fields = {name: stats[name] for name in pb.StatsResponse.DESCRIPTOR.fields_by_name
                  if name in stats}
        return pb.StatsResponse(
            worker_id=self.worker_id, **fields,
            served=convert.served_to_pb(self.served()),
            devices=convert.devices_to_pb(self.devices),
            checksums=[pb.KvChecksum(direction=d, request_id=r, checksum=c)
                       for (d, r), c in list(self.engine.debug_checksums().items())[::-1]])

    async def PauseWhen(self, request: pb.PauseWhenRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PauseWhenUpdate]:
        if not self.debug_hooks:
            raise FailedPrecondition("PauseWhen is a fault-test hook: start the worker with "
                                     "--debug-hooks")
        if request.min_output_tokens < 1:
            raise InvalidRequest("min_output_tokens must be at least 1",
                                 param="min_output_tokens")
        paused = self.engine.pause_when(request.min_output_tokens)
        yield pb.PauseWhenUpdate(state=pb.PauseWhenUpdate.ARMED)
        point = await paused
        yield pb.PauseWhenUpdate(state=pb.PauseWhenUpdate.PAUSED, num_running=point.num_running,
                                 min_output_tokens=point.min_output_tokens)
