#!/usr/bin/env python3
"""Container health check over the standard gRPC health service (grpc.health.v1).

    grpc-health-check HOST:PORT [--service NAME] [--timeout-s SECONDS]

One Check call; exits 0 when the service reports SERVING, 1 otherwise (NOT_SERVING while
starting or draining, an unknown service name, nothing listening, a timeout). Compose health
checks run it inside the container; Kubernetes probes gRPC health natively and needs no script.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str, timeout_s: float) -> bool:
    """True when `service` at `address` reports SERVING; the reason goes to stdout/stderr."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"{address} service={service!r}: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} service={service!r}: {status}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpc-health-check", description=__doc__.split("\n")[0])
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="",
                        help="service name to check (default: the server as a whole)")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    return 0 if check(args.address, args.service, args.timeout_s) else 1


if __name__ == "__main__":
    sys.exit(main())
