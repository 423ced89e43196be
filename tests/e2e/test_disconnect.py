"""A client that goes away mid-stream cancels the request all the way down to the engine.

The answers asked for would take ~45 s to finish on their own (1500 tokens at ~30 ms a step), and
the worker must report them gone within 5 s: only a real abort passes.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse

import grpc

from tandem.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.topology import Topology
from tests.e2e.worker_probe import LoadWatcher

ABORT_WITHIN_S = 5
LONG = 1500


def _wait_idle(watcher: LoadWatcher) -> int:
    return watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0
                            and load.kv_blocks_total > 0).kv_blocks_used


def _assert_running(watcher: LoadWatcher, idle_blocks: int) -> None:
    busy = watcher.wait_for(lambda load: load.num_running == 1)
    assert busy.kv_blocks_used > idle_blocks


def test_http_disconnect_aborts_engine_request_and_frees_blocks(
        slow_topology: Topology) -> None:
    topo = slow_topology
    watcher = LoadWatcher(topo.decode_addresses[0])
    try:
        idle_blocks = _wait_idle(watcher)
        url = urllib.parse.urlparse(topo.http_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        body = {"model": topo.model, "stream": True, "max_tokens": LONG, "ignore_eos": True,
                "messages": [{"role": "user", "content": "a long answer " * 20}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        events = 0
        while events < 5:  # a few tokens have streamed: the request is running
            events += response.fp.readline().startswith(b"data: ")
        _assert_running(watcher, idle_blocks)
        conn.sock.close()  # the client goes away mid-stream
        conn.close()
        freed = watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0,
                                 timeout=ABORT_WITHIN_S)
        assert freed.kv_blocks_used == idle_blocks
    finally:
        watcher.close()


def test_grpc_inference_cancel_aborts_engine_request(slow_topology: Topology) -> None:
    topo = slow_topology
    watcher = LoadWatcher(topo.decode_addresses[0])
    channel = grpc.insecure_channel(topo.grpc_address)
    try:
        idle_blocks = _wait_idle(watcher)
        call = inference_pb2_grpc.InferenceStub(channel).Generate(inference_pb2.InferenceRequest(
            model=topo.model, prompt="tell me everything " * 10,
            sampling=common_pb2.SamplingParams(max_tokens=LONG, ignore_eos=True)))
        for _ in range(3):
            next(call)
        _assert_running(watcher, idle_blocks)
        call.cancel()
        freed = watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0,
                                 timeout=ABORT_WITHIN_S)
        assert freed.kv_blocks_used == idle_blocks
    finally:
        watcher.close()
        channel.close()
