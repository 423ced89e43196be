"""Waits for a gRPC service to report SERVING (used by the launcher and tests)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.runtime.tls import TlsConfig, aio_channel


async def wait_serving(address: str, is_alive: Callable[[], bool], attempt_s: float = 2.0,
                       tls: TlsConfig | None = None) -> bool:
    """Returns True once `address` reports SERVING, False if `is_alive()` turns false first.

    Health Watch streams status changes; wait_for_ready holds each attempt until the port
    opens, and `attempt_s` bounds an attempt so a dead process is noticed.
    """
    async with aio_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while is_alive():
            try:
                async for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""),
                                              wait_for_ready=True, timeout=attempt_s):
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return True
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0)  # not listening yet: try again
    return False
