"""SIGTERM to a decode worker: health NOT_SERVING, in-flight streams finish, new ones refused."""
from __future__ import annotations

import signal
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.e2e.topology import start_worker

MAX_TOKENS = 300  # about 2 s of simulated decode steps at speedup 1


def generate(stub: decode_pb2_grpc.DecodeStub, request_id: str) -> grpc.Future:
    return stub.Generate(decode_pb2.GenerateRequest(
        request_id=request_id, token_ids=list(range(10, 60)),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))


def test_sigterm_drains_in_flight_and_refuses_new() -> None:
    proc, address = start_worker("--speedup-ratio", "1", "--grace-period-s", "30")
    channel = grpc.insecure_channel(address)
    stub = decode_pb2_grpc.DecodeStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

    streams = [generate(stub, f"drain-{i}") for i in range(3)]
    firsts = [next(s) for s in streams]  # every stream is running
    assert all(f.token_ids for f in firsts)
    results: dict[int, list[decode_pb2.GenerateChunk]] = {}

    def finish(i: int) -> None:
        results[i] = [firsts[i], *streams[i]]

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    proc.send_signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING

    try:
        list(generate(stub, "after-sigterm"))
        raise AssertionError("a new stream was accepted while draining")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc

    for t in threads:
        t.join(30)
    for chunks in results.values():
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert len(results) == 3
    assert proc.wait(timeout=30) == 0
    channel.close()
