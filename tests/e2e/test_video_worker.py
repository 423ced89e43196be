"""One `tandem serve video` process (tiny Wan, CPU) over real gRPC: a paused denoising loop
(the --debug-hooks test hook) with a job waiting turns health NOT_SERVING and back once steps
run again; SIGTERM refuses new jobs with UNAVAILABLE, lets the accepted one finish, and the
process exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.v1 import video_pb2 as pb
from tandem.v1 import video_pb2_grpc
from tests.e2e.test_stuck_engine import HealthWatch
from tests.e2e.topology import ROOT, free_ports, tandem_cmd, wait_serving

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                        str]]:
    (port,) = free_ports(1)
    proc = subprocess.Popen(tandem_cmd(
        "serve", "video", "--port", str(port), "--debug-hooks", "--progress-timeout-s", "0.5",
        "--grace-period-s", "20", "--media-output-dir", str(tmp_path_factory.mktemp("media"))),
        cwd=ROOT)
    address = f"127.0.0.1:{port}"
    wait_serving(address)
    yield proc, address
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _generate(address: str, steps: int) -> Iterator[pb.GenerateVideoResponse]:
    channel = grpc.insecure_channel(address)
    return video_pb2_grpc.VideoStub(channel).Generate(pb.GenerateVideoRequest(
        params=pb.VideoParams(prompt="a cat", width=32, height=32, num_frames=5,
                              num_inference_steps=steps, seed=1)))


def test_a_paused_loop_turns_health_not_serving_and_back(worker: tuple[subprocess.Popen[bytes],
                                                                       str]) -> None:
    proc, address = worker
    health = HealthWatch(address)
    try:
        assert health.next() == SERVING
        os.kill(proc.pid, signal.SIGUSR1)  # the loop holds before its next step
        stream = _generate(address, 3)
        assert next(stream).WhichOneof("event") == "accepted"
        assert health.next() == NOT_SERVING
        os.kill(proc.pid, signal.SIGUSR2)
        assert health.next() == SERVING
        events = [m.WhichOneof("event") for m in stream]
        assert events[-1] == "result"
    finally:
        health.close()


def test_sigterm_drains_accepted_jobs_and_refuses_new_ones(
        worker: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, address = worker
    health = HealthWatch(address)
    try:
        assert health.next() == SERVING
        stream = _generate(address, 100)
        assert next(stream).WhichOneof("event") == "accepted"
        proc.send_signal(signal.SIGTERM)
        assert health.next() == NOT_SERVING  # the drain began
        with pytest.raises(grpc.RpcError) as info:
            list(_generate(address, 1))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        events = [m.WhichOneof("event") for m in stream]
        assert events[-1] == "result" and events.count("progress") >= 1
        assert proc.wait(timeout=30) == 0
    finally:
        health.close()
