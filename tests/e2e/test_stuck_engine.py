"""Health that proves progress: a stuck engine (its step loop paused by the --debug-hooks test
hook) turns its worker NOT_SERVING, the router routes around it, and it comes back once the
engine makes progress again."""
from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.disagg_probe import child_pid, generate
from tests.e2e.topology import Topology, local_candidates, start_topology

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthWatch:
    """The statuses a worker's health Watch stream reports, in order."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=""))
        self.statuses: queue.Queue[int] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for reply in self._call:
                self.statuses.put(reply.status)
        except grpc.RpcError:
            pass  # closed by the test

    def next(self, timeout_s: float = 30) -> int:
        return self.statuses.get(timeout=timeout_s)

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def _served_by(http_url: str, model: str, n: int) -> list[str]:
    """The decode worker of each of `n` concurrent requests (all must succeed)."""
    body = json.dumps({"model": model, "max_tokens": 4, "prompt": "hello"}).encode()

    def post(_: int) -> str:
        request = urllib.request.Request(http_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=20) as reply:
            assert reply.status == 200
            return reply.headers["x-tandem-decode-worker"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(post, range(n)))


def _wait_local_candidates(topo: Topology, n: int, timeout_s: float = 60) -> None:
    """Until the frontend's local router (which routes every request here) routes to `n`
    workers: it follows each worker's health on a stream of its own, so it may learn of a
    change later than the test's watch, and its gauge is set every few seconds."""
    deadline = time.monotonic() + timeout_s
    while (seen := local_candidates(topo)) != n:
        assert time.monotonic() < deadline, f"the frontend routes to {seen} workers, not {n}"
        time.sleep(0.2)


def test_stuck_engine_turns_not_serving_and_is_routed_around() -> None:
    # One frontend process: its /metrics is the whole frontend's.
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--progress-timeout-s",
                          "1", "--debug-hooks", "--frontend-processes", "1", num_decode=2)
    stuck, healthy = topo.decode_addresses
    watch = HealthWatch(stuck)
    try:
        assert watch.next() == SERVING
        _wait_local_candidates(topo, 2)
        assert sorted(set(_served_by(topo.http_url, topo.model, 4))) == sorted(
            [healthy, stuck])
        pid = child_pid(topo.process.pid, int(stuck.rsplit(":", 1)[1]))
        os.kill(pid, signal.SIGUSR1)  # the step loop stops before its next step
        waiting: list[list[int]] = []
        direct = threading.Thread(target=lambda: waiting.append(
            generate(stuck, "stuck-1", [1, 2, 3], max_tokens=5)[0]), daemon=True)
        direct.start()
        assert watch.next() == NOT_SERVING
        assert not waiting  # the request really is stuck
        # The frontend's router sees the same health (on its own stream: once it has, and not
        # before, for a request routed to the stuck worker would wait for SIGUSR2): every new
        # request goes to the other worker.
        _wait_local_candidates(topo, 1)
        assert set(_served_by(topo.http_url, topo.model, 8)) == {healthy}
        os.kill(pid, signal.SIGUSR2)  # progress resumes
        assert watch.next() == SERVING
        direct.join(60)
        assert waiting and len(waiting[0]) == 5  # the stuck request completed
        # A candidate again, once the frontend's router heard of it too.
        _wait_local_candidates(topo, 2)
        assert any(stuck in _served_by(topo.http_url, topo.model, 8) for _ in range(3))
    finally:
        watch.close()
        assert topo.stop() == 0
