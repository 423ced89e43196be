"""A tensor-parallel worker under `tandem up` (real processes, the reference engine at two ranks
on the CPU): the router and `tandem status` see one worker per rank group; greedy answers equal
those of one-rank workers; kill -9 of a rank past the first under load takes its worker down
(the worker cannot go on without it), every stream completes on the other worker with the text
of an uninterrupted run, and the launcher starts the worker again."""
from __future__ import annotations

import os
import pathlib
import signal
import threading
from collections.abc import Iterator

import pytest

from tests.e2e.disagg_probe import child_pid
from tests.e2e.test_migration import MAX_TOKENS, Stream, _run_stream, _wait_until, client, prompt
from tests.e2e.test_supervision import services, status, wait_until
from tests.e2e.topology import Topology, start_topology

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
