"""`tandem up`'s processes talk over Unix-domain sockets in a private directory of the run: the
decode worker listens on `<dir>/<port>.sock`, the frontend's and the router's channels to it
dial that socket (the worker accepts their connections there, and the frontend holds no TCP
connection to its port), and the directory goes at exit. With --no-unix-sockets all of it is
TCP. Real processes, real gRPC; connections are read from /proc."""
from __future__ import annotations

import os
import pathlib

import openai
import pytest

from tandem.runtime.unix_sockets import SOCKET_DIR_ENV
from tests.e2e.disagg_probe import child_pid
from tests.e2e.topology import Topology, start_topology


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def accepted_unix(pid: int, path: str) -> int:
    """Connected sockets of `pid` bound to `path`: the connections its listener accepted."""
    inodes, count = socket_inodes(pid), 0
    for line in pathlib.Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode Path; St 03: connected.
        if len(fields) == 8 and fields[5] == "03" and int(fields[6]) in inodes \
                and fields[7] == path:
            count += 1
    return count


def tcp_to_port(pid: int, port: int) -> int:
    """`pid`'s established TCP connections to local port `port`."""
    inodes, count = socket_inodes(pid), 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if fields[3] == "01" and remote_port == port and int(fields[9]) in inodes:
                count += 1
    return count


def socket_dir_of(pid: int) -> str:
    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    prefix = SOCKET_DIR_ENV.encode() + b"="
    return next((e[len(prefix):].decode() for e in environ if e.startswith(prefix)), "")


def complete(topo: Topology) -> None:
    api = openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0,
                        timeout=60)
    reply = api.completions.create(model=topo.model, prompt="hello", max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4


def pids(topo: Topology) -> tuple[int, int, int, int]:
    """The decode worker's port and pid, the frontend's and the router's pids."""
    port = int(topo.decode_addresses[0].rsplit(":", 1)[1])
    http_port = int(topo.http_url.rsplit(":", 1)[1])
    router_port = int(topo.router_address.rsplit(":", 1)[1])
    return (port, child_pid(topo.process.pid, port),
            child_pid(topo.process.pid, http_port, b"--http-port"),
            child_pid(topo.process.pid, router_port))


def test_processes_of_one_run_talk_over_unix_sockets() -> None:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0")
    try:
        complete(topo)
        port, worker, frontend, router = pids(topo)
        directory = socket_dir_of(worker)
        assert directory and socket_dir_of(frontend) == directory == socket_dir_of(router)
        path = os.path.join(directory, f"{port}.sock")
        assert pathlib.Path(path).is_socket()
        # The router's watcher and the frontend's.
        assert accepted_unix(worker, path) >= 2
        # The frontend's decode session: plain frames on the worker's session socket.
        sessions = os.path.join(directory, f"{port}.session.sock")
        assert accepted_unix(worker, sessions) == 1
        assert tcp_to_port(frontend, port) == 0 and tcp_to_port(router, port) == 0
    finally:
        assert topo.stop() == 0
    assert not os.path.exists(directory)


def test_with_no_unix_sockets_everything_is_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory in the launcher's own environment is never passed on (another run's).
    monkeypatch.setenv(SOCKET_DIR_ENV, "/nonexistent-tandem-sockets")
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--no-unix-sockets")
    try:
        complete(topo)
        port, worker, frontend, router = pids(topo)
        assert socket_dir_of(worker) == socket_dir_of(frontend) == socket_dir_of(router) == ""
        assert tcp_to_port(frontend, port) >= 1 and tcp_to_port(router, port) >= 1
    finally:
        assert topo.stop() == 0
