"""Helpers that start Tandem the way users do (`tandem up`, `tandem serve`) on free ports."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90


#: Every port free_ports gave out in this process: the kernel may offer a closed one again, and
#: two calls (a test's own ports, then its topology's) must never share one.
_handed_out: set[int] = set()


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that nothing listened on just now, none of them handed out
    before in this process."""
    held: list[socket.socket] = []  # all bound until the end: the kernel offers each port once
    ports: list[int] = []
    try:
        while len(ports) < n:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            if (port := sock.getsockname()[1]) not in _handed_out:
                ports.append(port)
        _handed_out.update(ports)
        return ports
    finally:
        for sock in held:
            sock.close()


def tandem_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


@dataclass
class Topology:
    process: subprocess.Popen[str]
    http_url: str
    grpc_address: str
    model: str
    tokenizer_dir: str
    decode_addresses: list[str]
    router_address: str
    protos_root: str = str(ROOT / "protos")
    prefill_addresses: list[str] = dataclasses.field(default_factory=list)
    encode_addresses: list[str] = dataclasses.field(default_factory=list)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def start_topology(*extra: str, num_decode: int = 1, num_prefill: int = 0, num_encode: int = 0,
                   env: Mapping[str, str] | None = None, restart: bool = False,
                   log: pathlib.Path | None = None) -> Topology:
    """Runs `tandem up` on free ports and returns once it printed its READY line (every service
    serves and the router takes every worker as a candidate); with `num_prefill`,
    disaggregated (`--disagg`); with `num_encode`, an encode pool (`--encode-ports`); `env`
    adds to the environment of every service. Without `restart`, a service that dies stays
    down (`--restart-policy no`: the fault tests watch what its absence does); with it, the
    launcher restarts it as it does by default. With `log`, the log of every service (their
    shared stderr) goes to that file, for a test to read what they recorded."""
    http, grpc_port, router, *workers = free_ports(3 + num_decode + num_prefill + num_encode)
    if "--router-replicas" in extra:  # replica i listens on router + i
        router = consecutive_free_ports(int(extra[extra.index("--router-replicas") + 1]))[0]
    decode, prefill = workers[:num_decode], workers[num_decode:num_decode + num_prefill]
    encode = workers[num_decode + num_prefill:]
    disagg = ["--disagg", "--prefill-ports", *map(str, prefill)] if prefill else []
    if encode:
        disagg += ["--encode-ports", *map(str, encode)]
    argv = tandem_cmd("up", "--http-port", str(http), "--grpc-port", str(grpc_port),
                      "--router-port", str(router), "--decode-ports", *map(str, decode),
                      "--grace-period-s", "5", *disagg,
                      *([] if restart else ["--restart-policy", "no"]), *extra)
    with open(log, "ab") if log is not None else contextlib.nullcontext() as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    ready = _read_ready_line(proc)
    fields = dict(item.split("=", 1) for item in ready.split()[1:])
    # Keep draining stdout so the launcher never blocks on a full pipe.
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
    return Topology(proc, fields["http"], fields["grpc"], fields["model"], fields["tokenizer"],
                    [f"127.0.0.1:{p}" for p in decode], f"127.0.0.1:{router}",
                    prefill_addresses=[f"127.0.0.1:{p}" for p in prefill],
                    encode_addresses=[f"127.0.0.1:{p}" for p in encode])


def local_candidates(topo: Topology) -> float:
    """Workers the frontend's local router routes to, over every pool kind (its gauge, set
    every few seconds; the whole frontend's with one frontend process)."""
    with urllib.request.urlopen(topo.http_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(value) for value in re.findall(
        r"^tandem_frontend_local_candidates{[^}]*} (\S+)$", text, re.MULTILINE))


def _read_ready_line(proc: subprocess.Popen[str]) -> str:
    result: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("READY "):
                result.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if not result:
        # Its output ended (it failed: the reason is in its log) or the wait timed out.
        try:
            code: int | None = proc.wait(timeout=0 if reader.is_alive() else 30)
        except subprocess.TimeoutExpired:
            code = None
        proc.kill()
        why = f"exit code {code}" if code is not None else f"still starting after {START_TIMEOUT_S} s"
        raise RuntimeError(f"tandem up did not become ready ({why}; its log says why)")
    return result[0]


def start_worker(*extra: str, engine: str = "mock", port: int | None = None,
                 stage: str = "decode") -> tuple[subprocess.Popen[bytes], str]:
    """Runs one `tandem serve <stage>` worker and waits until its health says SERVING."""
    if port is None:
        (port,) = free_ports(1)
    proc = subprocess.Popen(tandem_cmd("serve", stage, "--port", str(port), "--engine",
                                       engine, *extra), cwd=ROOT)
    address = f"127.0.0.1:{port}"
    wait_serving(address)
    return proc, address


def terminate_all(procs: Sequence[subprocess.Popen[Any]]) -> None:
    """SIGTERM to every process, then each must drain and exit 0."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        assert proc.wait(timeout=30) == 0, proc.args


def wait_serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True,
                                timeout=START_TIMEOUT_S):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return


def consecutive_free_ports(n: int) -> list[int]:
    """`n` consecutive loopback ports nothing listened on just now (a service that gives its
    i-th process port + i, e.g. --frontend-metrics-port), none handed out before."""
    while True:
        (first,) = free_ports(1)
        ports = list(range(first, first + n))
        if _handed_out.isdisjoint(ports[1:]) and all(map(_is_free, ports[1:])):
            _handed_out.update(ports)
            return ports


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
