#!/usr/bin/env python3
"""Container health check over the standard gRPC health service (grpc.health.v1).

    grpc-health-check HOST:PORT [--service NAME] [--timeout-s SECONDS]

One Check call; exits 0 when the service reports SERVING, 1 otherwise (NOT_SERVING while
starting or draining, an unknown service name, nothing listening, a timeout). Compose health
checks run it inside the container; Kubernetes probes gRPC health natively and needs the script
only where the ports speak TLS (its native probe cannot).

TLS comes from the service's own variables, so a health check in the service's container needs
no flags: with TANDEM_TLS_CERT_FILE set it connects over TLS, verifies the server against
TANDEM_TLS_CA_FILE (default: the system's roots) under the name TANDEM_TLS_SERVER_NAME (default:
the host of ADDRESS) and presents that certificate and TANDEM_TLS_KEY_FILE (for mTLS ports).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def open_channel(address: str, environ: Mapping[str, str]) -> grpc.Channel:
    """A channel to `address`, over TLS when the environment has the service's TLS settings."""
    cert = environ.get("TANDEM_TLS_CERT_FILE", "")
    if not cert:
        return grpc.insecure_channel(address)
    ca, key = environ.get("TANDEM_TLS_CA_FILE", ""), environ.get("TANDEM_TLS_KEY_FILE", "")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pathlib.Path(ca).read_bytes() if ca else None,
        private_key=pathlib.Path(key).read_bytes(),
        certificate_chain=pathlib.Path(cert).read_bytes())
    name = environ.get("TANDEM_TLS_SERVER_NAME", "")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(address: str, service: str, timeout_s: float,
          environ: Mapping[str, str] = os.environ) -> bool:
    """True when `service` at `address` reports SERVING; the reason goes to stdout/stderr."""
    try:
        channel = open_channel(address, environ)
    except OSError as exc:
        print(f"cannot read a TLS file: {exc}", file=sys.stderr)
        return False
    with channel:
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
