"""Several frontend processes behind one port (`tandem up --frontend-processes 2`, and
`tandem serve frontend --processes 2` as a container runs it) with one router: both processes
serve, the router's in-flight counts return to zero, KV routing finds a prefix's holder whichever
process routes, SIGTERM drains every process, and a process that dies fails the whole."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest

from tandem.routing.snapshot import PoolSnapshot
from tandem.runtime.router_status import RouterStatusClient
from tests.e2e.test_launcher import children_of, wait_gone
from tests.e2e.topology import (
    ROOT,
    Topology,
    consecutive_free_ports,
    free_ports,
    start_topology,
    tandem_cmd,
    wait_serving,
)

#: How long the router may take to learn what its event streams and completion reports say
#: (they arrive within tens of ms; the bound only keeps a broken run from hanging).
SEE_CHANGE_S = 20
NUM_PROCESSES = 2


@dataclass
class Frontends:
    topo: Topology
    #: Frontend process i serves /metrics on metrics_ports[i].
    metrics_ports: list[int]


def requests_served(metrics_port: int) -> float:
    """Requests one frontend process answered (all endpoints and statuses)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_frontend_requests_total{"))


def served_counts(frontends: Frontends) -> list[float]:
    return [requests_served(port) for port in frontends.metrics_ports]


def router_pools(router: str) -> list[PoolSnapshot]:
    async def ask() -> list[PoolSnapshot]:
        async with RouterStatusClient(router) as client:
            return await client.list_workers()
    return asyncio.run(ask())


def wait_router(router: str, done: Callable[[list[PoolSnapshot]], bool],
                what: str) -> list[PoolSnapshot]:
    """The router's pools once `done(pools)` holds (asked at most every 50 ms)."""
    deadline = time.monotonic() + SEE_CHANGE_S
    while True:
        pools = router_pools(router)
        if done(pools):
            return pools
        assert time.monotonic() < deadline, f"router never showed {what}: {pools}"
        time.sleep(0.05)


def fresh_client(topo: Topology) -> openai.OpenAI:
    """A client with a connection of its own (a new source port: the kernel's SO_REUSEPORT
    hash may pick the other process)."""
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=30)


@pytest.fixture(scope="module")
def frontends() -> Iterator[Frontends]:
    metrics = consecutive_free_ports(NUM_PROCESSES)
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--router-policy", "kv",
                          "--frontend-processes", str(NUM_PROCESSES),
                          "--frontend-metrics-port", str(metrics[0]), num_decode=2)
    yield Frontends(topo, metrics)
    topo.stop()


def test_both_processes_serve_and_in_flight_returns_to_zero(frontends: Frontends) -> None:
    topo = frontends.topo
    before = served_counts(frontends)

    def one(i: int) -> str:
        with fresh_client(topo) as client:
            raw = client.completions.with_raw_response.create(
                model=topo.model, prompt=f"request {i} " * (i % 7 + 1), max_tokens=8)
            assert raw.parse().choices[0].finish_reason == "length"
            return raw.headers["x-tandem-decode-worker"]

    with ThreadPoolExecutor(max_workers=16) as pool:
        workers = list(pool.map(one, range(96)))
    after = served_counts(frontends)
    per_process = [a - b for a, b in zip(after, before)]
    assert sum(per_process) == 96 and all(n > 0 for n in per_process), per_process
    assert set(workers) == set(topo.decode_addresses)
    pools = wait_router(topo.router_address, lambda pools: all(
        w.in_flight_requests == 0 for p in pools for w in p.workers), "no request in flight")
    assert all(w.candidate for p in pools for w in p.workers)


def test_kv_routing_finds_the_prefix_holder_from_either_process(frontends: Frontends) -> None:
    topo = frontends.topo
    prefix = [(i * 7) % 3000 + 10 for i in range(320)]  # 10 blocks of 32
    before = served_counts(frontends)
    with fresh_client(topo) as client:
        raw = client.completions.with_raw_response.create(model=topo.model, prompt=prefix,
                                                          max_tokens=4)
    first = next(i for i, (a, b) in enumerate(zip(served_counts(frontends), before)) if a > b)
    holder = raw.headers["x-tandem-decode-worker"]
    wait_router(topo.router_address, lambda pools: any(
        w.worker_id == holder and w.indexed_blocks >= 10 for p in pools for w in p.workers),
        f"{holder} holding the prefix")
    by_process: dict[int, list[str]] = {}
    for n in range(40):  # fresh connections until the other process routed a few
        before = served_counts(frontends)
        with fresh_client(topo) as client:
            raw = client.completions.with_raw_response.create(
                model=topo.model, prompt=prefix[:288] + [3000 + n, 3001 + n], max_tokens=4)
        served = next(i for i, (a, b) in enumerate(zip(served_counts(frontends), before))
                      if a > b)
        by_process.setdefault(served, []).append(raw.headers["x-tandem-decode-worker"])
        if len(by_process.get(1 - first, [])) >= 3:
            break
        # The other process knows the request only from the worker's load reports: the next
        # request is routed once the worker said it is idle (it does at once, to every
        # subscriber; the router service is one of them).
        wait_router(topo.router_address, lambda pools: all(
            w.active_requests == w.active_decode_blocks == 0 for p in pools for w in p.workers),
            "every worker reporting itself idle")
    assert len(by_process.get(1 - first, [])) >= 3, by_process
    assert {w for workers in by_process.values() for w in workers} == {holder}, by_process


def test_sigterm_drains_every_frontend_process(frontends: Frontends) -> None:
    """Runs last in this module: it stops the shared topology."""
    topo = frontends.topo
    children = children_of(topo.process.pid)
    assert len(children) == 3 + NUM_PROCESSES  # two decode workers, router, frontends
    assert topo.stop() == 0
    assert wait_gone(children) == []


def test_a_frontend_process_that_dies_at_start_fails_tandem_up() -> None:
    metrics = consecutive_free_ports(NUM_PROCESSES)
    http, grpc_port, router, decode = free_ports(4)
    with socket.socket() as taken:  # frontend-1's metrics port: it cannot bind and exits
        taken.bind(("127.0.0.1", metrics[1]))
        taken.listen()
        result = subprocess.run(tandem_cmd(
            "up", "--engine", "mock", "--speedup-ratio", "0", "--frontend-processes", "2",
            "--frontend-metrics-port", str(metrics[0]), "--http-port", str(http), "--grpc-port",
            str(grpc_port), "--router-port", str(router), "--decode-ports", str(decode),
            "--grace-period-s", "5", "--log-format", "text"),
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem up: frontend-1 did not start:"), last
    assert "READY" not in result.stdout


@pytest.fixture
def supervisor() -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """`tandem serve frontend --processes 2` (as compose and Kubernetes run it), once both of
    its processes serve on their own gRPC ports; the router address leads nowhere (a frontend
    starts without one)."""
    http, grpc_port, router = free_ports(3)
    own = consecutive_free_ports(NUM_PROCESSES)
    proc = subprocess.Popen(tandem_cmd(
        "serve", "frontend", "--processes", str(NUM_PROCESSES), "--http-port", str(http),
        "--grpc-port", str(grpc_port), "--own-grpc-port", str(own[0]), "--router-address",
        f"127.0.0.1:{router}", "--grace-period-s", "5", "--log-format", "text"), cwd=ROOT)
    try:
        for port in own:
            wait_serving(f"127.0.0.1:{port}")
        yield proc, children_of(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_supervisor_stops_every_process_on_sigterm(
        supervisor: tuple[subprocess.Popen[bytes], list[int]]) -> None:
    proc, children = supervisor
    assert len(children) == NUM_PROCESSES
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert wait_gone(children) == []


def test_supervisor_exits_non_zero_when_a_process_dies(
        supervisor: tuple[subprocess.Popen[bytes], list[int]]) -> None:
    proc, children = supervisor
    os.kill(children[0], signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
    assert wait_gone(children) == []
