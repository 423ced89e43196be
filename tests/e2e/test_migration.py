"""No request lost when a worker dies (`tandem up`, real processes): kill -9 a decode worker while
20 greedy answers stream through it (half of 40), and every stream completes on the other worker
with the text of an uninterrupted run (the frontend migrates them); kill -9 the prefill worker
during a burst, and every request completes (another prefill worker or aggregated)."""
from __future__ import annotations

import os
import pathlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import openai
import pytest

from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.disagg_probe import child_pid, stats, wait_idle
from tests.e2e.topology import Topology, start_topology

#: Round robin over two decode workers: 20 of them through the one that dies.
NUM_STREAMS = 40
#: Long enough that the victim's streams are mid-answer when its step loop is held.
MAX_TOKENS = 150
#: Tokens every stream has received before the kill.
TOKENS_BEFORE_KILL = 4
#: Tokens each of the victim's streams has produced when its engine pauses before the kill.
PAUSE_AT_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", seed=0)


def client(topo: Topology, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


def prompt(i: int) -> str:
    return f"Request {i}: the quick brown fox jumps over the lazy dog"


@dataclass
class Stream:
    """One streaming request, as its client saw it."""

    index: int
    worker: str = ""
    text: str = ""
    num_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    #: Set by the test when it killed the worker: the tokens this stream had then.
    tokens_at_kill: int | None = None
    error: BaseException | None = None


def _run_stream(api: openai.OpenAI, model: str, stream: Stream) -> None:
    try:
        raw = api.completions.with_raw_response.create(
            model=model, prompt=prompt(stream.index), max_tokens=MAX_TOKENS, temperature=0,
            logprobs=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        stream.worker = raw.headers["x-tandem-decode-worker"]
        for chunk in raw.parse():
            if chunk.choices:
                choice = chunk.choices[0]
                stream.text += choice.text
                stream.num_tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
                stream.finish_reason = choice.finish_reason or stream.finish_reason
            if chunk.usage:
                stream.completion_tokens = chunk.usage.completion_tokens
                stream.prompt_tokens = chunk.usage.prompt_tokens
    except BaseException as exc:  # reported by the test, with the stream it broke
        stream.error = exc


def _wait_until(condition: Callable[[], bool], streams: list[Stream], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, (what, [(s.worker, s.num_tokens, s.error)
                                                     for s in streams])
        time.sleep(0.002)


def test_killing_a_decode_worker_loses_no_stream(model_dir: pathlib.Path) -> None:
    topo = start_topology("--engine", "reference", "--model", str(model_dir), "--device", "cpu",
                          "--kv-block-size", "32", "--num-gpu-blocks-override", "512",
                          "--debug-hooks", num_decode=2)
    try:
        api = client(topo)
        # The uninterrupted answers, from the same topology before anything died.
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            want = list(pool.map(lambda i: api.completions.create(
                model=topo.model, prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}), range(NUM_STREAMS)))
        assert len({w.choices[0].text for w in want}) > 1

        streams = [Stream(i) for i in range(NUM_STREAMS)]
        threads = [threading.Thread(target=_run_stream, args=(api, topo.model, s))
                   for s in streams]
        victim, survivor = topo.decode_addresses
        pids = [child_pid(topo.process.pid, int(a.rsplit(":", 1)[1])) for a in (victim, survivor)]
        # Both step loops held while the streams arrive, so that they start together: on a
        # loaded machine arrivals spread over longer than a whole answer takes.
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        for thread in threads:
            thread.start()
        _wait_until(lambda: sum(stats(a).num_waiting for a in (victim, survivor))
                    >= NUM_STREAMS, streams, "every stream queued at a worker")
        # The victim's engine pauses itself once every one of its streams is mid-answer (some
        # 10 tokens each: the clients' counts lag far behind on a loaded machine), so none of
        # them can finish while the clients catch up. The engine decides that at the end of a
        # step: a poll from here would race it (and lost, under a loaded test suite).
        with grpc.insecure_channel(victim) as channel:
            updates = worker_pb2_grpc.WorkerStub(channel).PauseWhen(
                worker_pb2.PauseWhenRequest(min_output_tokens=PAUSE_AT_TOKENS), timeout=120)
            assert next(updates).state == worker_pb2.PauseWhenUpdate.ARMED
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            paused = next(updates)
        assert paused.state == worker_pb2.PauseWhenUpdate.PAUSED
        # Round robin: half the streams, all admitted, none finished.
        assert paused.num_running == NUM_STREAMS // 2, paused
        assert PAUSE_AT_TOKENS <= paused.min_output_tokens < MAX_TOKENS, paused

        def under_way(s: Stream) -> bool:
            return s.num_tokens >= TOKENS_BEFORE_KILL or s.error is not None

        _wait_until(lambda: all(map(under_way, streams)), streams, "every stream under way")
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        for s in streams:
            s.tokens_at_kill = s.num_tokens
        for thread in threads:
            thread.join(timeout=60)

        assert [s.error for s in streams] == [None] * NUM_STREAMS
        # Round robin gave the killed worker half the streams, and they were mid-answer.
        on_victim = [s for s in streams if s.worker == victim]
        assert len(on_victim) == NUM_STREAMS // 2, {s.worker for s in streams}
        cut = [s for s in on_victim if s.tokens_at_kill is not None
               and s.tokens_at_kill < MAX_TOKENS]
        assert len(cut) == len(on_victim), [s.tokens_at_kill for s in on_victim]
        for s in streams:
            assert s.finish_reason == "length"
            assert s.num_tokens == s.completion_tokens == MAX_TOKENS
            assert s.text == want[s.index].choices[0].text, \
                f"stream {s.index} differs from its uninterrupted run"
            assert s.prompt_tokens == want[s.index].usage.prompt_tokens  # the client's prompt
        assert sum(s.completion_tokens for s in streams) == NUM_STREAMS * MAX_TOKENS
        # The router has learnt that the worker is gone: new requests go to the survivor.
        for _ in range(4):
            raw = api.completions.with_raw_response.create(model=topo.model, prompt="hi",
                                                           max_tokens=2)
            assert raw.headers["x-tandem-decode-worker"] == survivor
        assert time.monotonic() - killed_at < 60
        wait_idle(survivor)
    finally:
        topo.stop()


@pytest.fixture
def slow_disagg() -> Iterator[Topology]:
    # Mock engine at a tenth of real time: a burst's prefills take long enough to be cut.
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0.1", num_prefill=1)
    yield topo
    topo.stop()


def test_killing_the_prefill_worker_loses_no_request(slow_disagg: Topology) -> None:
    (decode,), (pre,) = slow_disagg.decode_addresses, slow_disagg.prefill_addresses
    api = client(slow_disagg)
    num_requests, max_tokens = 16, 8

    def ask(i: int) -> openai.types.Completion:
        return api.completions.create(model=slow_disagg.model,
                                      prompt=list(range(10 + i, 400 + i)), max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(num_requests) as pool:
        replies = [pool.submit(ask, i) for i in range(num_requests)]
        deadline = time.monotonic() + 30
        while not (s := stats(pre)).num_running + s.num_waiting + s.kv_leases:
            assert time.monotonic() < deadline, "the burst never reached the prefill worker"
            time.sleep(0.01)
        os.kill(child_pid(slow_disagg.process.pid, int(pre.rsplit(":", 1)[1])), signal.SIGKILL)
        answers = [reply.result(timeout=60) for reply in replies]
    assert [a.usage.completion_tokens for a in answers] == [max_tokens] * num_requests
    assert all(a.choices[0].finish_reason == "length" for a in answers)
    # Some requests were still to be prefilled when the worker died: the decode worker did it.
    assert stats(decode).kv_transfers_ok < num_requests
    wait_idle(decode)
