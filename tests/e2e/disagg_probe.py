"""Helpers for disaggregation tests: worker stats over the Worker service, direct Prefill and
Generate calls, and the pid of one child of `tandem up`."""
from __future__ import annotations

import pathlib
import time

import grpc

from tandem.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)


def stats(address: str) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)


def wait_idle(*addresses: str, timeout_s: float = 30) -> None:
    """Until every worker holds no KV block, no lease, no read in flight and no transfer
    buffer slot."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = [stats(a) for a in addresses]
        if all(s.kv_blocks_used == 0 and s.kv_leases == 0 and s.num_loading == 0
               and s.kv_transfer_buffer_blocks_used == 0 for s in current):
            return
        assert time.monotonic() < deadline, f"workers not idle: {current}"
        time.sleep(0.05)


def prefill(address: str, request_id: str, token_ids: list[int], lease_ms: int | None = None,
            timeout_s: float = 30) -> prefill_pb2.PrefillResponse:
    request = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=token_ids,
                                         sampling=common_pb2.SamplingParams(temperature=0.0, seed=1))
    if lease_ms is not None:
        request.lease_ms = lease_ms
    with grpc.insecure_channel(address) as channel:
        return prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=timeout_s)


def generate(address: str, request_id: str, token_ids: list[int], max_tokens: int,
             answer: prefill_pb2.PrefillResponse | None = None,
             timeout_s: float = 60) -> tuple[list[int], decode_pb2.GenerateChunk]:
    """All tokens of a Decode.Generate stream and its last chunk; with `answer`, resumed from
    that prefill's KV handle and first token."""
    request = decode_pb2.GenerateRequest(
        request_id=request_id, token_ids=token_ids,
        sampling=common_pb2.SamplingParams(temperature=0.0, seed=1, max_tokens=max_tokens))
    if answer is not None:
        request.kv_handle.CopyFrom(answer.kv_handle)
        request.first_token.CopyFrom(answer.first_token)
    tokens: list[int] = []
    last = decode_pb2.GenerateChunk()
    with grpc.insecure_channel(address) as channel:
        for chunk in decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=timeout_s):
            tokens += chunk.token_ids
            last = chunk
    return tokens, last


def child_pid(launcher_pid: int, port: int, flag: bytes = b"--port") -> int:
    """The pid of the `tandem up` child listening on `port` (from its command line; the
    frontend's is `--http-port`)."""
    children = pathlib.Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text()
    for pid in map(int, children.split()):
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if flag in argv and argv[argv.index(flag) + 1] == str(port).encode():
            return pid
    raise LookupError(f"no child of {launcher_pid} serves port {port}")
