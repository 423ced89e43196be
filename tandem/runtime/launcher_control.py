"""Launcher.ListPools and Launcher.ScalePool on both sides: the servicer `tandem up --planner`
runs over its PoolScaler, the client the planner's local connector calls, and the conversions.

The API listens on a Unix-domain socket in the launcher's private work directory (mode 0700):
only its own user's processes reach it, and nothing on the network does. Where that path is
too long for a socket, it listens on a loopback port instead."""
from __future__ import annotations

import os
from collections.abc import Sequence
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.launcher.pool_view import PoolView, ScaleResult, WorkerPhase, WorkerView
from tandem.launcher.scaling import PoolScaler
from tandem.runtime import status, unix_sockets
from tandem.runtime.health import HealthServicer
from tandem.runtime.interceptor import ErrorInterceptor
from tandem.v1 import launcher_pb2 as pb
from tandem.v1 import launcher_pb2_grpc

_PHASE_TO_PB = {WorkerPhase.STARTING: pb.LAUNCHER_WORKER_STATE_STARTING,
                WorkerPhase.SERVING: pb.LAUNCHER_WORKER_STATE_SERVING,
                WorkerPhase.DRAINING: pb.LAUNCHER_WORKER_STATE_DRAINING}
_PHASE_FROM_PB = {v: k for k, v in _PHASE_TO_PB.items()}


def pool_to_pb(view: PoolView) -> pb.LauncherPool:
    return pb.LauncherPool(name=view.name, kind=view.kind, max_workers=view.max_workers,
                           workers=[pb.LauncherWorker(
                               worker_id=w.worker_id, name=w.name, state=_PHASE_TO_PB[w.phase],
                               pid=w.pid, gpus=",".join(map(str, w.gpus)))
                               for w in view.workers])


def pool_from_pb(msg: pb.LauncherPool) -> PoolView:
    return PoolView(msg.name, msg.kind, tuple(
        WorkerView(w.worker_id, w.name, _PHASE_FROM_PB.get(w.state, WorkerPhase.STARTING),
                   tuple(int(g) for g in w.gpus.split(",")) if w.gpus else (), w.pid)
        for w in msg.workers), msg.max_workers)


class LauncherServicer(launcher_pb2_grpc.LauncherServicer):
    """Protobuf in, PoolScaler call, protobuf out."""

    def __init__(self, scaler: PoolScaler) -> None:
        self.scaler = scaler

    async def ListPools(self, request: pb.ListPoolsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=[pool_to_pb(v) for v in self.scaler.views()])

    async def ScalePool(self, request: pb.ScalePoolRequest,
                        context: grpc.aio.ServicerContext) -> pb.ScalePoolResponse:
        result = self.scaler.scale(request.pool, request.target, list(request.remove))
        return pb.ScalePoolResponse(pool=pool_to_pb(result.pool), shortfall=result.shortfall)


def control_address(workdir: str) -> str:
    """Where the launcher of work directory `workdir` serves the API: its socket, or "" when
    the path is too long (then `serve` binds a loopback port)."""
    path = os.path.join(workdir, "launcher.sock")
    return f"unix:{path}" if len(os.fsencode(path)) <= unix_sockets.MAX_PATH_BYTES else ""


async def serve(scaler: PoolScaler, address: str) -> tuple[grpc.aio.Server, str]:
    """Starts the API at `address` (control_address; "": a free loopback port), with health and
    reflection as every Tandem server has; returns the server and the address it took."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    launcher_pb2_grpc.add_LauncherServicer_to_server(LauncherServicer(scaler), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    reflection.enable_server_reflection(
        [pb.DESCRIPTOR.services_by_name["Launcher"].full_name,
         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server)
    if address:
        if not server.add_insecure_port(address):
            raise OSError(f"cannot bind the launcher's control socket {address}")
    else:
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, address


class LauncherClient:
    """Calls to one launcher's control API over one channel."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = launcher_pb2_grpc.LauncherStub(self._channel)

    async def list_pools(self, timeout_s: float = 10.0) -> list[PoolView]:
        """Every pool the launcher can resize. Raises TandemError (Unavailable when the
        launcher cannot be reached)."""
        try:
            reply = await self._stub.ListPools(pb.ListPoolsRequest(), timeout=timeout_s,
                                               wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise status.from_rpc_error(exc, f"launcher {self.address}") from None
        return [pool_from_pb(p) for p in reply.pools]

    async def scale_pool(self, pool: str, target: int, remove: Sequence[str] = (),
                         timeout_s: float = 10.0) -> ScaleResult:
        """ScalePool. Raises TandemError as the launcher mapped it (NotFound, InvalidRequest,
        Unavailable while it starts or cannot be reached)."""
        try:
            reply = await self._stub.ScalePool(
                pb.ScalePoolRequest(pool=pool, target=target, remove=list(remove)),
                timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise status.from_rpc_error(exc, f"launcher {self.address}") from None
        return ScaleResult(pool_from_pb(reply.pool), reply.shortfall)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> LauncherClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

