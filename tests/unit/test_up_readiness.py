"""`tandem up` is ready when the router takes every worker of every pool as a candidate (asked
through Router.ListWorkers of an in-process router), and fails start-up when a process exits
while it waits."""
from __future__ import annotations

import asyncio
import subprocess
from typing import cast

import grpc
import pytest

from services.router.servicer import RouterServicer
from tandem.launcher.topology import Topology
from tandem.launcher.workers import ServiceProcess
from tandem.routing.config import PoolConfig
from tandem.routing.router import Router
from tandem.routing.workers import Health
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.tls import TlsConfig
from tandem.v1 import router_pb2 as pb
from tandem.v1 import router_pb2_grpc


class Child:
    """A child process as the launcher sees it (poll, returncode)."""

    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


class CountingServicer(RouterServicer):
    """Signals each ListWorkers answer, so the test steps with the launcher's polls."""

    def __init__(self, router: Router) -> None:
        super().__init__(router, 1024)
        self.answered = asyncio.Event()

    async def ListWorkers(self, request: pb.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        reply = await super().ListWorkers(request, context)
        self.answered.set()
        return reply


def topology(router_address: str, children: dict[str, Child]) -> Topology:
    specs = [ServiceProcess(name, router_address if name == "router" else "unused", [])
             for name in children]
    topo = Topology(specs, TlsConfig())
    topo.children = cast(dict[str, subprocess.Popen[bytes]], children)
    return topo


async def test_ready_only_once_every_worker_is_a_candidate() -> None:
    router = Router([PoolConfig("decode", "decode", ["d:0", "d:1"]),
                     PoolConfig("prefill", "prefill", ["p:0"])], None, 4, 1024)
    workers = router.all_workers()
    for w in workers:
        w.healthy = False
    workers[0].health, workers[0].events_connected = Health.SERVING, True
    workers[0].refresh_candidacy()  # one candidate: enough for the router to serve
    servicer = CountingServicer(router)
    service = GrpcService(ServerOptions("127.0.0.1", 0, grace_s=1), ["tandem.v1.Router"])
    router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)
    await service.start()
    children = {"decode-0": Child(), "decode-1": Child(), "prefill-0": Child(), "router": Child()}
    try:
        waiting = asyncio.create_task(topology(service.address, children)._wait_candidates())
        for w in workers[1:]:
            servicer.answered.clear()
            await asyncio.wait_for(servicer.answered.wait(), 10)
            assert not waiting.done()  # not ready while a worker is not a candidate
            w.health, w.events_connected = Health.SERVING, True
            w.refresh_candidacy()
        await asyncio.wait_for(waiting, 10)
    finally:
        await service.shutdown()


async def test_a_process_that_exits_while_waiting_fails_start_up() -> None:
    router = Router([PoolConfig("decode", "decode", ["d:0"])], None, 4, 1024)
    router.all_workers()[0].healthy = False
    servicer = CountingServicer(router)
    service = GrpcService(ServerOptions("127.0.0.1", 0, grace_s=1), ["tandem.v1.Router"])
    router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)
    await service.start()
    children = {"decode-0": Child(), "router": Child()}
    try:
        waiting = asyncio.create_task(topology(service.address, children)._wait_candidates())
        await asyncio.wait_for(servicer.answered.wait(), 10)
        children["decode-0"].returncode = -9
        with pytest.raises(RuntimeError, match="decode-0 exited with code -9 before it was ready"):
            await asyncio.wait_for(waiting, 10)
    finally:
        await service.shutdown()
