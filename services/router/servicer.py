"""Router servicer: protobuf in, routing library call, protobuf out."""
from __future__ import annotations

import grpc

from tandem.routing.round_robin import RoundRobinRouter
from tandem.routing.workers import WorkerRef
from tandem.v1 import router_pb2 as pb
from tandem.v1 import router_pb2_grpc


def _ref(worker: WorkerRef) -> pb.WorkerRef:
    return pb.WorkerRef(worker_id=worker.worker_id, address=worker.address, pool=worker.pool)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: RoundRobinRouter) -> None:
        self.router = router

    async def Route(self, request: pb.RouteRequest,
                    context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        for done in request.completed:
            self.router.complete(done.request_id)
        decision = self.router.route(request.request_id, tuple(request.exclude_worker_ids))
        return pb.RouteResponse(decode_workers=[_ref(w) for w in decision.decode_workers],
                                prefill_workers=[_ref(w) for w in decision.prefill_workers],
                                encode_workers=[_ref(w) for w in decision.encode_workers],
                                disaggregate=decision.disaggregate,
                                overlap_blocks=decision.overlap_blocks)

    async def Complete(self, request: pb.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        released = sum(self.router.complete(c.request_id) for c in request.completions)
        return pb.CompleteResponse(released=released)
