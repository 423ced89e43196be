"""deploy/docker/grpc_health_check.py, the containers' health check: exit 0 only while the named
service reports SERVING, 1 otherwise (not serving, unknown, nothing listening)."""
from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

HEALTH_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "docker" / "grpc_health_check.py"


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def run_health_check(*args: str) -> int:
    return subprocess.run([sys.executable, str(HEALTH_SCRIPT), *args], capture_output=True,
                          timeout=30).returncode


def test_health_check_script_exits_by_serving_status(
        health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("tandem.v1.Decode", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("tandem.v1.Prefill", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_health_check(address, "--service", "tandem.v1.Decode") == 0
    assert run_health_check(address, "--service", "tandem.v1.Prefill") == 1
    assert run_health_check(address, "--service", "tandem.v1.Unknown") == 1
    servicer.set("tandem.v1.Decode", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_health_check(address, "--service", "tandem.v1.Decode") == 1


def test_health_check_script_fails_when_nothing_listens() -> None:
    with socket_bound() as port:  # a port that is bound but never accepts gRPC
        assert run_health_check(f"127.0.0.1:{port}", "--timeout-s", "0.5") == 1


@contextlib.contextmanager
def socket_bound() -> Iterator[int]:
    """A port reserved for the duration of a `with` block and not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])
