"""Worker servicer: the engine's stats snapshot, protobuf out."""
from __future__ import annotations

import dataclasses

import grpc

from tandem.engines.base import Engine
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, engine: Engine) -> None:
        self.worker_id = worker_id
        self.engine = engine

    async def Stats(self, request: pb.StatsRequest,
                    context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = dataclasses.asdict(self.engine.stats())
        fields = {name: stats[name] for name in pb.StatsResponse.DESCRIPTOR.fields_by_name
                  if name in stats}
        return pb.StatsResponse(
            worker_id=self.worker_id, **fields,
            checksums=[pb.KvChecksum(direction=d, request_id=r, checksum=c)
                       for (d, r), c in list(self.engine.debug_checksums().items())[::-1]])
