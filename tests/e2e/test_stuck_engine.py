"""Health that proves progress: a stuck engine (its step loop paused by the --debug-hooks test
hook) turns its worker NOT_SERVING, the router routes around it, and it comes back once the
engine makes progress again."""
from __future__ import annotations

import json
import os
import queue
import signal
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.disagg_probe import child_pid, generate
from tests.e2e.topology import start_topology

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

    def next(self, timeout_s: float = 15) -> int:
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


def test_stuck_engine_turns_not_serving_and_is_routed_around() -> None:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--progress-timeout-s",
                          "1", "--debug-hooks", num_decode=2)
    stuck, healthy = topo.decode_addresses
    watch = HealthWatch(stuck)
    try:
        assert watch.next() == SERVING
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
        # The router saw the same health stream: every new request goes to the other worker.
        assert set(_served_by(topo.http_url, topo.model, 8)) == {healthy}
        os.kill(pid, signal.SIGUSR2)  # progress resumes
        assert watch.next() == SERVING
        direct.join(20)
        assert waiting and len(waiting[0]) == 5  # the stuck request completed
        # A candidate again (the router hears of it on its own health stream, so allow it a
        # round or two to catch up with ours).
        assert any(stuck in _served_by(topo.http_url, topo.model, 8) for _ in range(3))
    finally:
        watch.close()
        assert topo.stop() == 0
