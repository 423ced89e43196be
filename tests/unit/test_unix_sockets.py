"""Unix-domain sockets between local processes (tandem.runtime.unix_sockets): a server given a
socket directory also listens on `<dir>/<port>.sock` (not with TLS or SO_REUSEPORT), a channel
to a local address dials that socket when it exists, and without the directory everything is
TCP. Real gRPC servers and channels."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.runtime import unix_sockets
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.tls import TlsConfig, aio_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A short private directory (socket paths are limited to 107 bytes), set as the
    launcher sets it for its children."""
    directory = tempfile.mkdtemp(prefix="uds-")
    monkeypatch.setenv(unix_sockets.SOCKET_DIR_ENV, directory)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_dial_target_without_a_directory_is_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(unix_sockets.SOCKET_DIR_ENV, raising=False)
    assert unix_sockets.dial_target("127.0.0.1:9200") == "127.0.0.1:9200"


def test_dial_target_takes_an_existing_socket_of_a_local_address(socket_dir: str) -> None:
    unix_sockets.reserve(socket_dir, 9200)
    path = os.path.join(socket_dir, "9200.sock")
    for address in ("127.0.0.1:9200", "localhost:9200", "0.0.0.0:9200", "[::1]:9200"):
        assert unix_sockets.dial_target(address) == f"unix:{path}", address
    # Another host's port 9200, a port without a socket, and targets that are not host:port.
    for address in ("10.1.2.3:9200", "worker-0.decode:9200", "127.0.0.1:9201",
                    "dns:///127.0.0.1:9200", f"unix:{path}", "127.0.0.1"):
        assert unix_sockets.dial_target(address) == address, address


def test_a_session_socket_is_dialed_only_where_it_exists(socket_dir: str) -> None:
    assert unix_sockets.session_dial_path("127.0.0.1:9200") is None
    path = unix_sockets.session_socket_path(socket_dir, 9200)
    assert unix_sockets.session_server_path("127.0.0.1", 9200) == path
    assert unix_sockets.session_server_path("10.1.2.3", 9200) is None
    pathlib.Path(path).touch()
    assert unix_sockets.session_dial_path("127.0.0.1:9200") == path
    assert unix_sockets.session_dial_path("10.1.2.3:9200") is None


def test_reserve_keeps_a_socket_already_there(socket_dir: str) -> None:
    unix_sockets.reserve(socket_dir, 9200)
    unix_sockets.reserve(socket_dir, 9200)
    assert pathlib.Path(socket_dir, "9200.sock").is_socket()


def test_server_paths_only_for_local_hosts_and_short_paths(socket_dir: str) -> None:
    assert unix_sockets.server_path("127.0.0.1", 9200) == os.path.join(socket_dir, "9200.sock")
    assert unix_sockets.server_path("0.0.0.0", 9200) is not None
    assert unix_sockets.server_path("10.1.2.3", 9200) is None
    assert not unix_sockets.fits("/" + "d" * 100)


async def check(address: str) -> int:
    async with aio_channel(address, None) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10)
    return int(reply.status)


@pytest.fixture
async def tcp_only() -> AsyncIterator[int]:
    """A plain gRPC server on a loopback TCP port, SERVING."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(0)


async def test_a_local_channel_dials_the_socket_and_without_it_tcp(
        tcp_only: int, socket_dir: str) -> None:
    # A second server, on the socket of the TCP server's port only, answers NOT_SERVING: the
    # answer tells which of the two a channel to 127.0.0.1:<port> reached.
    decoy = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, decoy)
    decoy.add_insecure_port(f"unix:{unix_sockets.socket_path(socket_dir, tcp_only)}")
    await decoy.start()
    try:
        assert await check(f"127.0.0.1:{tcp_only}") == NOT_SERVING
        os.environ.pop(unix_sockets.SOCKET_DIR_ENV)
        assert await check(f"127.0.0.1:{tcp_only}") == SERVING
    finally:
        await decoy.stop(0)


async def test_a_service_listens_on_its_socket_and_removes_it_at_stop(socket_dir: str) -> None:
    service = GrpcService(ServerOptions(port=0, grace_s=0.1), service_names=[])
    await service.start()
    path = unix_sockets.socket_path(socket_dir, service.port)
    assert service.unix_path == path and pathlib.Path(path).is_socket()
    assert unix_sockets.dial_target(service.address) == f"unix:{path}"
    assert await check(service.address) == SERVING
    await service.shutdown()
    assert not os.path.exists(path)


async def test_no_socket_without_a_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(unix_sockets.SOCKET_DIR_ENV, raising=False)
    service = GrpcService(ServerOptions(port=0, grace_s=0.1), service_names=[])
    await service.start()
    try:
        assert service.unix_path is None
        assert unix_sockets.dial_target(service.address) == service.address
        assert await check(service.address) == SERVING
    finally:
        await service.shutdown()


def self_signed(tmp_path: pathlib.Path) -> TlsConfig:
    cert, key = tmp_path / "c.pem", tmp_path / "c.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=t"], check=True, capture_output=True)
    return TlsConfig(str(cert), str(key), str(cert))


@pytest.mark.parametrize("kind", ["reuse_port", "tls"])
async def test_no_socket_for_a_shared_port_or_under_tls(kind: str, socket_dir: str,
                                                        tmp_path: pathlib.Path) -> None:
    """SO_REUSEPORT: several processes share the port, and one path could belong to one of
    them. TLS verifies the peer, which the socket would skip."""
    if kind == "tls" and shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    options = (ServerOptions(port=0, grace_s=0.1, reuse_port=True) if kind == "reuse_port" else
               ServerOptions(port=0, grace_s=0.1, tls=self_signed(tmp_path)))
    service = GrpcService(options, service_names=[])
    try:
        assert service.unix_path is None
        assert os.listdir(socket_dir) == []
    finally:
        await service.server.stop(0)
