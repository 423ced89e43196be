"""grpc.health.v1 servicer whose Watch streams end at shutdown.

The stock aio servicer keeps Watch streams open forever, so a drain with any watcher (a router,
an orchestrator) would always last the whole grace period. Here `close()` reports NOT_SERVING to
every watcher and then ends their streams, letting the server stop as soon as real work is done.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ServingStatus = int
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._status: dict[str, ServingStatus] = {"": SERVING}
        self._changed = asyncio.Condition()
        self._closed = False

    async def set(self, service: str, status: ServingStatus) -> None:
        """Publishes a status; a no-op after `close` (a closing server never serves again,
        whatever a late reporter such as the progress watchdog says)."""
        async with self._changed:
            if self._closed:
                return
            self._status[service] = status
            self._changed.notify_all()

    async def close(self) -> None:
        """Every service NOT_SERVING from now on; Watch streams end after saying so."""
        async with self._changed:
            self._closed = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._changed.notify_all()

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last: ServingStatus | None = None
        while True:
            async with self._changed:
                status = self._status.get(request.service,
                                          health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                closed = self._closed
                if status == last and not closed:
                    await self._changed.wait()
                    continue
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if closed:
                return
