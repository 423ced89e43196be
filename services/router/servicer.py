"""Router servicer: protobuf in, routing library call, protobuf out."""
from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from tandem.errors import Unavailable
from tandem.routing.metrics import RouterMetrics
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.snapshot import RoutingSettings
from tandem.routing.workers import SlaHints, WorkerRef
from tandem.runtime import tracing
from tandem.runtime.router_status import ROUTER_VERDICT_KEY, pools_to_pb
from tandem.v1 import router_pb2 as pb
from tandem.v1 import router_pb2_grpc


def _ref(worker: WorkerRef) -> pb.WorkerRef:
    return pb.WorkerRef(worker_id=worker.worker_id, address=worker.address, pool=worker.pool)


def route_info(request: pb.RouteRequest, default_osl: int) -> RouteRequestInfo:
    sla = request.sla
    return RouteRequestInfo(
        request_id=request.request_id,
        token_ids=request.token_ids,
        block_hashes=request.block_hashes,
        isl=request.isl if request.HasField("isl") else len(request.token_ids),
        expected_osl=request.expected_osl if request.HasField("expected_osl") else default_osl,
        sla=SlaHints(sla.ttft_ms if sla.HasField("ttft_ms") else None,
                     sla.itl_ms if sla.HasField("itl_ms") else None,
                     request.priority if request.HasField("priority") else None),
        exclude_ids=tuple(request.exclude_worker_ids),
        max_local_prefill_length=request.max_local_prefill_length,
        has_images=request.has_images,
        prefer_ids=tuple(request.prefer_worker_ids),
        video=request.video,
        embedding=request.embedding)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """`is_ready` says whether the router may decide yet: a (re)started router first rebuilds
    its prefix index from every worker's event stream; until then Route answers UNAVAILABLE
    (an outage, which frontends fail over, not a verdict). `grid_config_json` is the SLA grid
    file's text, listed with the pools for frontends' local routers."""

    def __init__(self, router: Router, default_osl: int,
                 metrics: RouterMetrics | None = None,
                 is_ready: Callable[[], bool] = lambda: True, grid_config_json: str = "") -> None:
        self.router = router
        #: Sent with every ListWorkers: a frontend's local router decides with it.
        self.settings = RoutingSettings(router.block_size, router.typical_osl, grid_config_json)
        self.default_osl = default_osl
        self.metrics = metrics or RouterMetrics()
        self.is_ready = is_ready

    async def Route(self, request: pb.RouteRequest,
                    context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        for done in request.completed:
            self.router.complete(done.request_id)
        if not self.is_ready():
            raise Unavailable("router starting: its index is not rebuilt from every worker's "
                              "event stream yet")
        start = time.perf_counter()
        try:
            decision = self.router.route(route_info(request, self.default_osl))
        except Unavailable:
            self.metrics.unroutable.inc()
            context.set_trailing_metadata(((ROUTER_VERDICT_KEY, "unroutable"),))
            raise
        self.metrics.observe(decision, time.perf_counter() - start)
        if tracing.is_enabled():
            pick = decision.pick
            tracing.annotate({"tandem.route.decode_worker": pick.worker_id,
                              "tandem.route.pool": pick.pool,
                              "tandem.route.disaggregate": decision.disaggregate,
                              "tandem.route.overlap_blocks": decision.overlap_blocks})
        return pb.RouteResponse(decode_workers=[_ref(w) for w in decision.decode_workers],
                                prefill_workers=[_ref(w) for w in decision.prefill_workers],
                                encode_workers=[_ref(w) for w in decision.encode_workers],
                                disaggregate=decision.disaggregate,
                                overlap_blocks=decision.overlap_blocks,
                                video_workers=[_ref(w) for w in decision.video_workers],
                                embedding_workers=[_ref(w) for w in decision.embedding_workers])

    async def Complete(self, request: pb.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        released = sum(self.router.complete(c.request_id) for c in request.completions)
        return pb.CompleteResponse(released=released)

    async def ListWorkers(self, request: pb.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        return pools_to_pb(self.router.snapshot(time.monotonic()), self.settings)
