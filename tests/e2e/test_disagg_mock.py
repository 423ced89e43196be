"""Disaggregated serving with the mock engine (`tandem up --disagg`): the routing and lease
flow end to end, conditional disaggregation, and the faults that need a slow transfer (the mock
simulates transfer time from --mock-kv-transfer-gbps). Every fault ends with both workers'
pools back to their starting free blocks."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from tandem.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.disagg_probe import child_pid, generate, prefill, stats, wait_idle
from tests.e2e.topology import Topology, start_topology, start_worker

#: The demo model's mock KV block: 2 layers x K,V x 32 tokens x 2 heads x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * 32 * 2 * 16 * 4
#: Tokens per prompt in the slow tests: 4 blocks; at SLOW_GBPS their read takes ~2 s.
SLOW_PROMPT = list(range(10, 130))
SLOW_GBPS = 4 * BLOCK_BYTES / 2.0 / 1e9


@pytest.fixture(scope="module")
def disagg() -> Iterator[Topology]:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0",
                          "--max-local-prefill-length", "40", num_prefill=1)
    yield topo
    assert topo.stop() == 0


def client(topo: Topology, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


def test_long_prompts_go_through_the_prefill_worker(disagg: Topology) -> None:
    (decode,), (pre,) = disagg.decode_addresses, disagg.prefill_addresses
    before = stats(decode)
    prompt = list(range(10, 110))
    out = client(disagg).completions.create(model=disagg.model, prompt=prompt, max_tokens=12,
                                            temperature=0, seed=1)
    after = stats(decode)
    assert after.kv_transfers_ok == before.kv_transfers_ok + 1
    assert after.kv_bytes_received - before.kv_bytes_received == 4 * BLOCK_BYTES
    assert out.usage.completion_tokens == 12
    # The same request aggregated on the decode worker yields the same tokens.
    aggregated, _ = generate(decode, "agg-long", prompt, 12)
    answer, _ = generate(decode, "disagg-long", prompt, 12, prefill(pre, "disagg-long", prompt))
    assert answer == aggregated
    wait_idle(decode, pre)


def test_short_prompts_are_prefilled_by_the_decode_worker(disagg: Topology) -> None:
    (decode,), (pre,) = disagg.decode_addresses, disagg.prefill_addresses
    before = stats(decode)
    out = client(disagg).chat.completions.create(
        model=disagg.model, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert out.choices[0].finish_reason == "length"
    assert stats(decode).kv_transfers_ok == before.kv_transfers_ok
    wait_idle(decode, pre)


def test_a_lease_that_expired_before_the_read_is_recomputed(disagg: Topology) -> None:
    (decode,), (pre,) = disagg.decode_addresses, disagg.prefill_addresses
    prompt = list(range(200, 300))
    expected, _ = generate(decode, "fresh", prompt, 8)
    answer = prefill(pre, "short-lease", prompt, lease_ms=50)
    deadline = time.monotonic() + 5
    while stats(pre).kv_leases and time.monotonic() < deadline:  # the expiry frees it
        time.sleep(0.01)
    assert stats(pre).kv_leases == 0
    before = stats(decode)
    tokens, last = generate(decode, "short-lease", prompt, 8, answer)
    assert tokens == expected and last.usage.completion_tokens == 8
    assert stats(decode).kv_transfers_failed == before.kv_transfers_failed + 1
    wait_idle(decode, pre)


def test_a_handle_with_another_layout_is_refused_by_name(disagg: Topology) -> None:
    (decode,), (pre,) = disagg.decode_addresses, disagg.prefill_addresses
    prompt = list(range(40, 120))
    answer = prefill(pre, "layout", prompt)
    answer.kv_handle.layout.num_kv_heads = 8
    answer.kv_handle.layout.dtype = "float16"
    with pytest.raises(grpc.RpcError) as err:
        generate(decode, "layout", prompt, 4, answer)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "num_kv_heads 8 != 2" in err.value.details() and "dtype" in err.value.details()
    # Nobody read it: the prefill worker still holds the lease until released.
    assert stats(pre).kv_leases == 1
    with grpc.insecure_channel(pre) as channel:
        from tandem.v1 import prefill_pb2, prefill_pb2_grpc
        released = prefill_pb2_grpc.PrefillStub(channel).Release(
            prefill_pb2.ReleaseRequest(request_id="layout"))
    assert released.released
    wait_idle(decode, pre)


def test_cancelling_a_prefill_frees_it() -> None:
    # 100x slower than real time: a 1,500-token prompt takes seconds.
    proc, pre = start_worker("--speedup-ratio", "0.01", stage="prefill")
    try:
        with pytest.raises(grpc.RpcError) as err:
            prefill(pre, "slow", list(range(4, 1504)), timeout_s=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(pre)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def slow() -> Iterator[Topology]:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--mock-kv-transfer-gbps",
                          str(SLOW_GBPS), num_prefill=1)
    yield topo
    topo.stop()


def _wait_loading(address: str) -> None:
    for _ in range(200):
        if stats(address).num_loading:
            return
        time.sleep(0.02)
    raise AssertionError("the read never started")


def test_a_client_gone_during_the_transfer_leaves_nothing_behind(slow: Topology) -> None:
    (decode,), (pre,) = slow.decode_addresses, slow.prefill_addresses
    with pytest.raises(openai.APITimeoutError):
        client(slow, timeout=1.0).completions.create(model=slow.model, prompt=SLOW_PROMPT,
                                                     max_tokens=4)
    # The read was still writing when the client left; its blocks come back when it ends.
    wait_idle(decode, pre)
    assert stats(decode).kv_transfers_ok == 1


def test_a_decode_worker_killed_mid_transfer_frees_the_prefill_lease(slow: Topology) -> None:
    (decode,), (pre,) = slow.decode_addresses, slow.prefill_addresses
    port = int(decode.rsplit(":", 1)[1])
    killer = threading.Thread(target=lambda: (_wait_loading(decode), os.kill(
        child_pid(slow.process.pid, port), signal.SIGKILL)))
    killer.start()
    with pytest.raises(openai.APIError):
        client(slow).completions.create(model=slow.model, prompt=SLOW_PROMPT, max_tokens=4)
    killer.join()
    # The frontend saw the decode stream break before any token and released the lease.
    wait_idle(pre)


def test_n_choices_share_the_prefill(disagg: Topology) -> None:
    # Choice 0 is prefilled on the prefill worker; the other two are sent once it has its first
    # token, preferring its workers (RouteRequest.prefer_worker_ids), and find the prompt's 3
    # full blocks in a prefix cache: each computes only the last 4 tokens.
    (decode,), (pre,) = disagg.decode_addresses, disagg.prefill_addresses
    with grpc.insecure_channel(disagg.grpc_address) as channel:
        chunks = list(inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.InferenceRequest(
                model=disagg.model, tokens=inference_pb2.TokenInput(token_ids=range(300, 400)),
                n=3, sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True, seed=5)),
            timeout=60))
    usage = {c.index: c.usage for c in chunks if c.HasField("usage")}
    assert [usage[i].completion_tokens for i in (0, 1, 2)] == [8, 8, 8]
    assert [usage[i].cached_tokens for i in (0, 1, 2)] == [0, 96, 96]
    wait_idle(decode, pre)
