"""Decode.Session against a real decode worker (mock engine at half real-time speed): many requests on
one stream, one batch per engine step, per-request errors and cancellation, and the session's end
aborting what still runs. Blocks coming back is read from the worker's own load reports."""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.e2e.topology import start_worker, terminate_all
from tests.e2e.worker_probe import LoadWatcher

LONG = 1500  # ~20 s of tokens at half real-time speed: only an abort ends it within the test


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    proc, address = start_worker("--speedup-ratio", "0.5")
    try:
        yield address
    finally:
        terminate_all([proc])


class Session:
    """One Session call: `send` puts a request on it, `next_batch` reads the worker's batches."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self._outbox: queue.Queue[decode_pb2.SessionRequest | None] = queue.Queue()
        self.call = decode_pb2_grpc.DecodeStub(self.channel).Session(iter(self._outbox.get, None))
        self.batches: queue.Queue[decode_pb2.SessionBatch | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.put(batch)
        except grpc.RpcError:
            pass
        self.batches.put(None)

    def generate(self, request_id: str, token_ids: list[int], max_tokens: int) -> None:
        self._outbox.put(decode_pb2.SessionRequest(generate=decode_pb2.GenerateRequest(
            request_id=request_id, token_ids=token_ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))))

    def cancel(self, request_id: str) -> None:
        self._outbox.put(decode_pb2.SessionRequest(cancel_request_id=request_id))

    def next_batch(self) -> decode_pb2.SessionBatch:
        batch = self.batches.get(timeout=30)
        assert batch is not None, "the session ended"
        return batch

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def _idle_blocks(watcher: LoadWatcher) -> int:
    return watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0
                            and load.kv_blocks_total > 0).kv_blocks_used


def test_requests_share_batches_and_each_completes(worker: str) -> None:
    session = Session(worker)
    try:
        ids = [f"share-{i}" for i in range(4)]
        for i, request_id in enumerate(ids):
            session.generate(request_id, [5 + i, 6, 7, 8, 9], max_tokens=24)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        finished: dict[str, decode_pb2.GenerateChunk] = {}
        shared = 0
        while len(finished) < len(ids):
            batch = session.next_batch()
            shared += len({c.request_id for c in batch.chunks if c.chunk.token_ids}) > 1
            for item in batch.chunks:
                assert not item.HasField("error"), item.error
                assert item.request_id not in finished, "nothing after the last chunk"
                tokens[item.request_id] += item.chunk.token_ids
                if item.chunk.finish_reason:
                    finished[item.request_id] = item.chunk
        for request_id in ids:
            assert len(tokens[request_id]) == 24
            last = finished[request_id]
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 24)
        # The point of the stream: a step's tokens of several requests travel in one message.
        assert shared >= 10, f"only {shared} batches carried more than one request"
    finally:
        session.close()


def test_a_bad_request_fails_alone(worker: str) -> None:
    session = Session(worker)
    try:
        session.generate("good", [1, 2, 3], max_tokens=8)
        session.generate("empty", [], max_tokens=8)
        session.generate("good", [4, 5, 6], max_tokens=8)  # its id is running already
        errors: dict[str, decode_pb2.RequestError] = {}
        good_tokens = 0
        done = False
        while not done or len(errors) < 2:
            for item in session.next_batch().chunks:
                if item.HasField("error"):
                    errors[f"{item.request_id}#{len(errors)}"] = item.error
                else:
                    good_tokens += len(item.chunk.token_ids)
                    done = done or bool(item.chunk.finish_reason)
        assert good_tokens == 8
        codes = sorted((e.code, e.message) for e in errors.values())
        assert [c for c, _ in codes] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 2
        assert any("token_ids" in m for _, m in codes)
        assert any("already running" in m for _, m in codes)
    finally:
        session.close()


def test_cancel_returns_the_blocks_and_stops_the_chunks(worker: str) -> None:
    watcher = LoadWatcher(worker)
    session = Session(worker)
    try:
        idle = _idle_blocks(watcher)
        session.generate("stay", list(range(1, 40)), max_tokens=LONG)
        session.generate("leave", list(range(50, 90)), max_tokens=LONG)
        seen: set[str] = set()
        while seen != {"stay", "leave"}:
            batch = session.next_batch()
            assert not any(c.HasField("error") for c in batch.chunks), batch
            seen |= {c.request_id for c in batch.chunks}
        session.cancel("leave")
        watcher.wait_for(lambda load: load.num_running == 1, timeout=5)
        for _ in range(5):  # drain what was on its way, then only "stay" streams
            session.next_batch()
        for _ in range(5):
            assert {c.request_id for c in session.next_batch().chunks} == {"stay"}
        session.close()  # the caller goes away: the session aborts "stay"
        freed = watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0,
                                 timeout=5)
        assert freed.kv_blocks_used == idle
    finally:
        session.close()
        watcher.close()


def _batches_for(address: str, max_tokens: int) -> list[list[int]]:
    """The token lists of the batches that carried one request to its end."""
    session = Session(address)
    try:
        session.generate("paced", [5, 6, 7, 8], max_tokens=max_tokens)
        out: list[list[int]] = []
        while True:
            item = session.next_batch().chunks[0]
            out.append(list(item.chunk.token_ids))
            if item.chunk.finish_reason:
                return out
    finally:
        session.close()


def test_steps_within_the_session_interval_go_out_as_one_batch() -> None:
    # Steps of ~11.5 ms (half real-time speed); a 60 ms interval takes about five per batch, a
    # request's tokens merged in order; with no interval each step is a batch.
    paced, address = start_worker("--speedup-ratio", "0.5", "--session-interval-ms", "60")
    per_step, address_0 = start_worker("--speedup-ratio", "0.5", "--session-interval-ms", "0")
    try:
        batches = _batches_for(address, 30)
        steps = _batches_for(address_0, 30)
    finally:
        terminate_all([paced, per_step])
    assert sum(map(len, batches)) == sum(map(len, steps)) == 30
    assert len(steps) >= 25
    assert len(batches) <= 12
    assert max(map(len, batches)) >= 3
