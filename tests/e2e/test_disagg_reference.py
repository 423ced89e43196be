"""Disaggregated serving on the reference engine with real NIXL (UCX between processes): greedy
tokens equal aggregated serving and transformers, the bytes that arrived equal the bytes that
were leased, and the faults that need real bytes (a prefill worker killed after answering, forged
handles) end with the request served and every pool back to its starting free blocks."""
from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from tests.e2e.disagg_probe import generate, prefill, stats, wait_idle
from tests.e2e.test_reference_engine import Reference
from tests.e2e.topology import Topology, start_topology, start_worker

BLOCK_SIZE = 16
MAX_TOKENS = 8
ENGINE_FLAGS = ("--engine", "reference", "--device", "cpu", "--kv-block-size", str(BLOCK_SIZE),
                "--num-gpu-blocks-override", "256")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir: pathlib.Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def topo(model_dir: pathlib.Path) -> Iterator[Topology]:
    topo = start_topology(*ENGINE_FLAGS, "--model", str(model_dir), "--debug-kv-checksums",
                          num_prefill=1)
    yield topo
    assert topo.stop() == 0


def block_bytes(model_dir: pathlib.Path) -> int:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"] * head
            * 4)  # float32 on CPU


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(4, vocab) for _ in range(40)]
    mixed = [[rng.randrange(4, vocab) for _ in range(n)] for n in (1, 5, 16, 17, 31, 64, 90)]
    # Two prompts extend the shared prefix (served once beforehand): prefill-side cache hits.
    return [*mixed, shared + [5, 6, 7], shared + [rng.randrange(4, vocab) for _ in range(23)]]


def test_disaggregated_greedy_equals_aggregated_and_transformers(
        topo: Topology, reference: Reference, model_dir: pathlib.Path) -> None:
    (decode,), (pre,) = topo.decode_addresses, topo.prefill_addresses
    client = openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)
    batch = prompts(reference.tokenizer.vocab_size)
    # The shared prefix enters the prefill worker's cache (directly: the router may not count
    # the prefill worker as a candidate yet, and would then serve this one aggregated).
    prefill(pre, "warm", batch[-1][:40] + [9], lease_ms=1)
    before = stats(decode)

    def complete(ids: list[int]) -> openai.types.Completion:
        return client.completions.create(model=topo.model, prompt=ids, max_tokens=MAX_TOKENS,
                                         temperature=0)

    with ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(complete, batch))
    after = stats(decode)
    assert after.kv_transfers_ok - before.kv_transfers_ok == len(batch)
    # Every prompt fit both transfer buffers (a quarter of 256 blocks): one descriptor each.
    assert after.kv_reads_buffered - before.kv_reads_buffered == len(batch)
    assert after.kv_reads_by_region == before.kv_reads_by_region
    assert after.kv_transfer_buffer_blocks_total == 64
    blocks = sum(-(-len(ids) // BLOCK_SIZE) for ids in batch)
    assert after.kv_bytes_received - before.kv_bytes_received == blocks * block_bytes(model_dir)
    for ids, answer in zip(batch, answers, strict=True):
        expected, _ = reference.greedy(ids, MAX_TOKENS)
        assert answer.choices[0].text == reference.text(expected)
        aggregated, _ = generate(decode, f"agg-{len(ids)}-{ids[0]}", ids, MAX_TOKENS)
        assert aggregated == expected
    assert all(a.usage.prompt_tokens_details.cached_tokens >= 32 for a in answers[-2:])
    # The bytes the decode worker received are the bytes the prefill worker leased.
    leased = {c.request_id: c.checksum for c in stats(pre).checksums if c.direction == "leased"}
    received = {c.request_id: c.checksum for c in after.checksums if c.direction == "received"}
    common = leased.keys() & received.keys()
    assert len(common) >= len(batch)
    assert all(leased[r] == received[r] for r in common)
    wait_idle(decode, pre)


def test_disaggregated_tokens_through_grpc_equal_transformers(
        topo: Topology, reference: Reference, model_dir: pathlib.Path) -> None:
    (decode,), (pre,) = topo.decode_addresses, topo.prefill_addresses
    ids = list(range(100, 149))  # 3 full blocks and 1 token
    answer = prefill(pre, "grpc-direct", ids)
    assert answer.kv_handle.backend == 1 and answer.kv_handle.nixl_agent_name  # NIXL
    # The prompt's 4 blocks were copied into the transfer buffer: one descriptor over them.
    (whole,) = answer.kv_handle.descriptors
    assert whole.length == 4 * block_bytes(model_dir)
    tokens, last = generate(decode, "grpc-direct", ids, MAX_TOKENS, answer)
    assert tokens == reference.greedy(ids, MAX_TOKENS)[0]
    assert last.usage.prompt_tokens == len(ids)
    wait_idle(decode, pre)


Pair = tuple["subprocess.Popen[bytes]", str, "subprocess.Popen[bytes]", str]


@pytest.fixture(scope="module")
def pair(model_dir: pathlib.Path) -> Iterator[Pair]:
    """A prefill and a decode worker (failure policy "fail"), no frontend or router. The
    last test kills the prefill worker."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        prefill_proc, pre = start_worker(*ENGINE_FLAGS[2:], "--model", str(model_dir),
                                         engine="reference", stage="prefill")
        procs.append(prefill_proc)
        decode_proc, decode = start_worker(*ENGINE_FLAGS[2:], "--model", str(model_dir),
                                           "--kv-load-failure-policy", "fail",
                                           engine="reference")
        procs.append(decode_proc)
        yield prefill_proc, pre, decode_proc, decode
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(30)


def test_forged_handles_never_reach_foreign_memory(pair: Pair) -> None:
    _, pre, _, decode = pair
    ids = list(range(500, 540))
    rng = random.Random(3)
    for i, forge in enumerate(("addresses", "lengths", "metadata")):
        answer = prefill(pre, f"forged-{i}", ids)
        handle = answer.kv_handle
        if forge == "addresses":
            for d in handle.descriptors:
                d.address = rng.randrange(1 << 40, 1 << 47)
        elif forge == "lengths":
            handle.descriptors[0].length *= 4096
        else:
            handle.nixl_agent_metadata = os.urandom(len(handle.nixl_agent_metadata))
            handle.nixl_agent_name = f"forged-agent-{i}"
        with pytest.raises(grpc.RpcError) as err:
            generate(decode, f"forged-{i}", ids, MAX_TOKENS, answer)
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.FAILED_PRECONDITION)
        wait_idle(decode, pre)  # the decode side released the lease after the failed read
    assert stats(decode).kv_transfers_failed == 3


def test_a_prefill_worker_killed_after_answering_fails_the_read_cleanly(
        pair: Pair, reference: Reference) -> None:
    prefill_proc, pre, _, decode = pair
    ids = list(range(300, 340))
    answer = prefill(pre, "orphan", ids)
    failed_before = stats(decode).kv_transfers_failed
    os.kill(prefill_proc.pid, signal.SIGKILL)
    prefill_proc.wait(10)
    with pytest.raises(grpc.RpcError) as err:
        generate(decode, "orphan", ids, MAX_TOKENS, answer)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "KV" in err.value.details()
    assert stats(decode).kv_transfers_failed == failed_before + 1
    wait_idle(decode)
    # The worker is unharmed: the same prompt aggregated still matches transformers.
    assert generate(decode, "after", ids, MAX_TOKENS)[0] == reference.greedy(ids, MAX_TOKENS)[0]
