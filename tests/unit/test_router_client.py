"""RouterClient against a real router gRPC server (in-process): completions ride on the next
Route, or go out in one Complete after the flush delay; the router's counts return to zero."""
from __future__ import annotations

import asyncio

from services.router.servicer import RouterServicer
from tandem.routing.config import PoolConfig
from tandem.routing.router import Router
from tandem.routing.workers import SlaHints
from tandem.runtime.clients import RouterClient
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.v1 import router_pb2_grpc


class ObservedRouter(Router):
    """Signals every release so the test can await it instead of sleeping."""

    def __init__(self) -> None:
        super().__init__([PoolConfig("decode", "decode", ["w0"])], None, 32, 1024)
        self.released = asyncio.Event()
        self.complete_calls: list[str] = []

    def complete(self, request_id: str) -> bool:
        self.complete_calls.append(request_id)
        self.released.set()
        return super().complete(request_id)


async def _serve(router: ObservedRouter) -> GrpcService:
    service = GrpcService(ServerOptions("127.0.0.1", 0, grace_s=1), ["tandem.v1.Router"])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router, 1024), service.server)
    await service.start()
    return service


async def test_completions_ride_on_the_next_route() -> None:
    router = ObservedRouter()
    service = await _serve(router)
    client = RouterClient(service.address, flush_ms=60_000)  # the timer never fires here
    try:
        await client.route("a", [1, 2, 3], 8, SlaHints())
        await client.route("b", [1, 2, 3], 8, SlaHints())
        assert router.in_flight("w0") == 2
        client.report_completion("a", "ok", 8)
        client.report_completion("b", "cancelled", 3)
        await client.route("c", [4], 8, SlaHints())
        assert router.complete_calls == ["a", "b"]
        assert router.in_flight("w0") == 1  # only "c"
    finally:
        await client.close()  # flushes nothing: nothing pending
        await service.shutdown()
    assert router.complete_calls == ["a", "b"]


async def test_idle_completions_flush_in_one_complete_call() -> None:
    router = ObservedRouter()
    service = await _serve(router)
    client = RouterClient(service.address, flush_ms=5)
    try:
        for rid in ("x", "y"):
            await client.route(rid, [1], 4, SlaHints())
        client.report_completion("x", "ok", 4)
        client.report_completion("y", "error", 0)
        await asyncio.wait_for(router.released.wait(), timeout=10)
        assert router.complete_calls == ["x", "y"]  # both in the same call
        assert router.in_flight("w0") == 0
    finally:
        await client.close()
        await service.shutdown()


async def test_close_flushes_pending_completions() -> None:
    router = ObservedRouter()
    service = await _serve(router)
    client = RouterClient(service.address, flush_ms=60_000)
    await client.route("z", [1], 4, SlaHints())
    client.report_completion("z", "ok", 4)
    await client.close()
    assert router.in_flight("w0") == 0
    await service.shutdown()
