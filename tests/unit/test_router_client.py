"""RouterClient against a real router gRPC server (in-process): completions ride on the next
Route, or go out in one Complete after the flush delay; the router's counts return to zero."""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from services.router.servicer import RouterServicer
from tandem.errors import Unavailable
from tandem.routing.config import PoolConfig
from tandem.routing.router import Router
from tandem.routing.workers import SlaHints
from tandem.runtime.router_client import RouterClient
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


# ---- several replicas, and none -------------------------------------------------------------

class TwoWorkerRouter(ObservedRouter):
    def __init__(self) -> None:
        Router.__init__(self, [PoolConfig("decode", "decode", ["w0", "w1"],
                                          policy="kv")], None, 32, 1024)
        self.released = asyncio.Event()
        self.complete_calls = []


async def _serve_at(router: Router, port: int = 0,
                    is_ready: Callable[[], bool] = lambda: True) -> GrpcService:
    service = GrpcService(ServerOptions("127.0.0.1", port, grace_s=0.1), ["tandem.v1.Router"])
    router_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(router, 1024, is_ready=is_ready), service.server)
    await service.start()
    return service


async def test_routes_spread_over_replicas_and_completions_return_to_the_one_that_counted() -> None:
    routers = [ObservedRouter(), ObservedRouter()]
    services = [await _serve_at(r) for r in routers]
    client = RouterClient([s.address for s in services], flush_ms=60_000)
    try:
        for i in range(4):
            await client.route(f"r{i}", [1, 2], 8, SlaHints())
        assert [r.in_flight("w0") for r in routers] == [2, 2]
        for i in range(4):
            client.report_completion(f"r{i}", "ok", 8)
        await client.flush()
        assert [r.in_flight("w0") for r in routers] == [0, 0]
        assert sorted(routers[0].complete_calls + routers[1].complete_calls) == \
            ["r0", "r1", "r2", "r3"]
    finally:
        await client.close()
        for service in services:
            await service.shutdown()


async def test_a_dead_replica_is_failed_over_then_taken_back_once_serving() -> None:
    routers = [ObservedRouter(), ObservedRouter()]
    services = [await _serve_at(r) for r in routers]
    port = int(services[0].address.rsplit(":", 1)[1])
    client = RouterClient([s.address for s in services], flush_ms=60_000)
    try:
        await services[0].shutdown()
        for i in range(6):  # none fails: the live replica answers each
            decision = await client.route(f"a{i}", [1], 4, SlaHints())
            assert decision.decode_workers[0].worker_id == "w0"
        assert routers[1].in_flight("w0") == 6
        assert not client.is_fallback_active
        # The replica comes back on its port: the client probes its health and uses it again.
        restarted = ObservedRouter()
        services[0] = await _serve_at(restarted, port)
        await _until(lambda: client.replica_states() == ["up", "up"])
        for i in range(4):
            await client.route(f"b{i}", [1], 4, SlaHints())
        assert restarted.in_flight("w0") == 2
    finally:
        await client.close()
        for service in services:
            await service.shutdown()


async def test_without_any_router_the_client_routes_alone_by_load_and_says_so() -> None:
    router = TwoWorkerRouter()
    service = await _serve_at(router)
    port = int(service.address.rsplit(":", 1)[1])
    changes: list[bool] = []
    alone: list[int] = []
    client = RouterClient(service.address, flush_ms=60_000,
                          on_fallback=changes.append, on_fallback_route=lambda: alone.append(1))
    client.start()
    try:
        await _until(lambda: client.fallback.updated_at is not None)  # the first worker list
        await service.shutdown()
        picks = [(await client.route(f"f{i}", [1] * 64, 8, SlaHints())).decode_workers[0]
                 for i in range(6)]
        # kv needs the router's index: least loaded over the frontend's own counts instead.
        assert sorted(Counter(p.worker_id for p in picks).values()) == [3, 3]
        assert changes == [True] and len(alone) == 6
        for i in range(6):
            client.report_completion(f"f{i}", "ok", 8)
        # A router on the same port again, serving once it is ready (its index rebuilt).
        ready = False
        service = await _serve_at(TwoWorkerRouter(), port, is_ready=lambda: ready)
        await service.set_serving(False)
        replica = client.replicas.all[0]
        answered = replica.num_probe_answers
        await _until(lambda: replica.num_probe_answers >= answered + 2)  # NOT_SERVING twice

        await client.route("g0", [1], 8, SlaHints())
        assert changes == [True] and len(alone) == 7
        ready = True
        await service.set_serving(True)
        await _until(lambda: client.replica_states() == ["up"])
        await client.route("g1", [1], 8, SlaHints())
        assert changes == [True, False] and len(alone) == 7
    finally:
        await client.close()
        await service.shutdown()


async def test_a_routers_verdict_is_raised_not_failed_over() -> None:
    router = ObservedRouter()
    for worker in router.all_workers():
        worker.healthy = False
    services = [await _serve_at(router), await _serve_at(ObservedRouter())]
    changes: list[bool] = []
    client = RouterClient([s.address for s in services], on_fallback=changes.append)
    try:
        with pytest.raises(Unavailable, match="no healthy worker"):
            for i in range(2):  # one of the two lands on the replica that has no worker
                await client.route(f"v{i}", [1], 4, SlaHints())
        assert client.replica_states() == ["up", "up"] and changes == []
    finally:
        await client.close()
        for service in services:
            await service.shutdown()


async def test_a_router_that_is_not_ready_is_an_outage() -> None:
    services = [await _serve_at(ObservedRouter(), is_ready=lambda: False),
                await _serve_at(ObservedRouter())]
    client = RouterClient([s.address for s in services])
    try:
        for i in range(4):
            await client.route(f"n{i}", [1], 4, SlaHints())
        assert client.replica_states() == ["down", "up"]
    finally:
        await client.close()
        for service in services:
            await service.shutdown()


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_a_dns_name_stands_for_every_replica_behind_it() -> None:
    router = ObservedRouter()
    service = await _serve_at(router)
    port = service.address.rsplit(":", 1)[1]
    client = RouterClient(f"dns:localhost:{port}", flush_ms=60_000)
    client.start()
    try:
        for i in range(3):  # routed by the replica behind the name (an IPv6 twin may be down)
            await client.route(f"d{i}", [1], 4, SlaHints())
        assert router.in_flight("w0") == 3
        assert f"127.0.0.1:{port}" in [r.address for r in client.replicas.all]
    finally:
        await client.close()
        await service.shutdown()
