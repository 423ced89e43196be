"""A tensor-parallel worker under `tandem up` (real processes, the reference engine at two ranks
on the CPU): the router and `tandem status` see one worker per rank group; greedy answers equal
those of one-rank workers; kill -9 of a rank past the first under load takes its worker down
(the worker cannot go on without it), every stream completes on the other worker with the text
of an uninterrupted run, and the launcher starts the worker again."""
from __future__ import annotations

import os
import pathlib
import random
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.disagg_probe import child_pid, generate, prefill, stats, wait_idle
from tests.e2e.test_migration import MAX_TOKENS, Stream, _run_stream, _wait_until, client, prompt
from tests.e2e.test_reference_engine import Reference
from tests.e2e.test_supervision import services, status, wait_until
from tests.e2e.topology import Topology, start_topology, start_worker

NUM_STREAMS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", seed=0)


def _topology(model_dir: pathlib.Path, tp: int) -> Topology:
    return start_topology("--engine", "reference", "--model", str(model_dir), "--device", "cpu",
                          "--kv-block-size", "32", "--num-gpu-blocks-override", "256",
                          "--tensor-parallel-size", str(tp), num_decode=2, restart=True)


@pytest.fixture(scope="module")
def one_rank_answers(model_dir: pathlib.Path) -> list[str]:
    topo = _topology(model_dir, 1)
    try:
        api = client(topo)
        return [api.completions.create(model=topo.model, prompt=prompt(i), max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True}
                                       ).choices[0].text for i in range(NUM_STREAMS)]
    finally:
        topo.stop()


@pytest.fixture
def topo(model_dir: pathlib.Path) -> Iterator[Topology]:
    topology = _topology(model_dir, 2)
    yield topology
    topology.stop()


def rank_pid(worker_pid: int) -> int:
    """The pid of the worker's rank-1 process (a spawned child; the other child, if any, is
    multiprocessing's resource tracker)."""
    path = pathlib.Path(f"/proc/{worker_pid}/task/{worker_pid}/children")
    for pid in map(int, path.read_text().split()):
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in argv:
            return pid
    raise LookupError(f"worker {worker_pid} has no rank process")


def test_killing_a_rank_loses_no_stream_and_the_worker_comes_back(
        topo: Topology, one_rank_answers: list[str]) -> None:
    workers = {w["worker_id"] for p in status(topo)["pools"] for w in p["workers"]}
    assert workers == set(topo.decode_addresses)  # one worker per rank group
    api = client(topo)
    victim = topo.decode_addresses[0]
    worker_pid = child_pid(topo.process.pid, int(victim.rsplit(":", 1)[1]))
    victim_rank = rank_pid(worker_pid)

    streams = [Stream(i) for i in range(NUM_STREAMS)]
    threads = [threading.Thread(target=_run_stream, args=(api, topo.model, s)) for s in streams]
    for thread in threads:
        thread.start()
    _wait_until(lambda: sum(s.worker == victim and s.num_tokens >= 2 for s in streams) >= 2,
                streams, "streams under way on the victim")
    os.kill(victim_rank, signal.SIGKILL)
    for s in streams:
        s.tokens_at_kill = s.num_tokens
    for thread in threads:
        thread.join(timeout=120)

    assert [s.error for s in streams] == [None] * NUM_STREAMS
    cut = [s for s in streams if s.worker == victim and s.tokens_at_kill < MAX_TOKENS]
    assert cut, "no stream was mid-answer on the killed worker"
    for s in streams:
        assert s.num_tokens == s.completion_tokens == MAX_TOKENS
        assert s.text == one_rank_answers[s.index], f"stream {s.index} differs at two ranks"
    # The worker left with its rank (exit code 70) and was started again, with a rank of its own.
    wait_until(lambda: services(topo)["decode-0"]["restarts"] == 1,
               "the launcher did not restart the worker", 120)
    assert services(topo)["decode-0"]["last_exit"] == "exit code 70"
    wait_until(lambda: _new_rank(topo, victim) not in (None, victim_rank),
               "the restarted worker has no rank of its own", 120)


def _new_rank(topo: Topology, worker: str) -> int | None:
    """The rank-1 pid of the worker now serving `worker`, None while it starts."""
    try:
        return rank_pid(child_pid(topo.process.pid, int(worker.rsplit(":", 1)[1])))
    except (LookupError, FileNotFoundError):
        return None


@pytest.fixture(scope="module")
def reference(model_dir: pathlib.Path) -> Reference:
    return Reference(model_dir)


def test_disaggregated_two_ranks_to_two_ranks_equal_transformers(
        model_dir: pathlib.Path, reference: Reference) -> None:
    topo = start_topology("--engine", "reference", "--model", str(model_dir), "--device", "cpu",
                          "--kv-block-size", "16", "--num-gpu-blocks-override", "256",
                          "--tensor-parallel-size", "2", num_prefill=1)
    try:
        (decode,), (pre,) = topo.decode_addresses, topo.prefill_addresses
        # Directly over gRPC first: the handle carries rank 1's shard beside rank 0's.
        ids = list(range(100, 149))  # 3 full blocks and 1 token
        answer = prefill(pre, "tp-direct", ids)
        assert len(answer.kv_handle.ranks) == 1 and answer.kv_handle.ranks[0].nixl_agent_name
        assert answer.kv_handle.ranks[0].nixl_agent_name != answer.kv_handle.nixl_agent_name
        tokens, _ = generate(decode, "tp-direct", ids, 8, answer)
        assert tokens == reference.greedy(ids, 8)[0]
        # Through the frontend: every prompt disaggregated, both shards read.
        rng = random.Random(7)
        batch = [[rng.randrange(4, reference.tokenizer.vocab_size) for _ in range(n)]
                 for n in (1, 16, 17, 45, 90)]
        before = stats(decode)
        api = client(topo)
        with ThreadPoolExecutor(len(batch)) as pool:
            answers = list(pool.map(lambda p: api.completions.create(
                model=topo.model, prompt=p, max_tokens=8, temperature=0), batch))
        after = stats(decode)
        assert after.kv_transfers_ok - before.kv_transfers_ok == len(batch)
        blocks = sum(-(-len(p) // 16) for p in batch)
        # float32, 2 layers, 16 tokens, 2 KV heads of 16 over both ranks, K and V.
        assert after.kv_bytes_received - before.kv_bytes_received == blocks * 2 * 2 * 16 * 2 * 16 * 4
        for p, got in zip(batch, answers, strict=True):
            assert got.choices[0].text == reference.text(reference.greedy(p, 8)[0])
        wait_idle(decode, pre)
    finally:
        assert topo.stop() == 0


def test_a_dead_prefill_worker_or_another_rank_count_fails_the_read_cleanly(
        model_dir: pathlib.Path, reference: Reference) -> None:
    flags = ("--model", str(model_dir), "--device", "cpu", "--kv-block-size", "16",
             "--num-gpu-blocks-override", "256")
    procs = []
    try:
        two, pre_two = start_worker(*flags, "--tensor-parallel-size", "2", engine="reference",
                                    stage="prefill")
        procs.append(two)
        one, pre_one = start_worker(*flags, engine="reference", stage="prefill")
        procs.append(one)
        decode_proc, decode = start_worker(*flags, "--tensor-parallel-size", "2",
                                           "--kv-load-failure-policy", "fail",
                                           engine="reference")
        procs.append(decode_proc)
        ids = list(range(300, 340))
        # A handle of one rank into a worker of two: refused, saying why.
        with pytest.raises(grpc.RpcError) as err:
            generate(decode, "one-rank", ids, 8, prefill(pre_one, "one-rank", ids))
        assert "--tensor-parallel-size" in err.value.details()
        # Both prefill ranks die after answering (rank 1 with its parent): every decode rank's
        # read fails and ends, and the pool is whole again.
        answer = prefill(pre_two, "orphan", ids)
        os.kill(two.pid, signal.SIGKILL)
        two.wait(10)
        with pytest.raises(grpc.RpcError) as err:
            generate(decode, "orphan", ids, 8, answer)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "KV" in err.value.details()
        wait_idle(decode)
        assert generate(decode, "after", ids, 8)[0] == reference.greedy(ids, 8)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(30)
