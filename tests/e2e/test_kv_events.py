"""KvEvents: a subscriber that reconnects with its last sequence number misses nothing."""
from __future__ import annotations

import signal

import grpc

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc
from tests.e2e.topology import start_worker


def run_requests(stub: decode_pb2_grpc.DecodeStub, first: int, count: int) -> None:
    for i in range(first, first + count):
        # Distinct prompts of 3 full blocks each, so every request stores new blocks.
        list(stub.Generate(decode_pb2.GenerateRequest(
            request_id=f"ev-{i}", token_ids=[(i * 97 + j) % 900 + 20 for j in range(100)],
            sampling=common_pb2.SamplingParams(max_tokens=40, ignore_eos=True))))


def batches_until(call, sequence: int) -> list[kv_events_pb2.KvEventBatch]:
    out = []
    for message in call:
        if message.WhichOneof("payload") == "batch":
            out.append(message.batch)
            if message.batch.sequence >= sequence:
                return out
    raise AssertionError("stream ended early")


def steps(batch: kv_events_pb2.KvEventBatch) -> range:
    first = batch.first_sequence if batch.HasField("first_sequence") else batch.sequence
    return range(first, batch.sequence + 1)


def events_of(batches: list[kv_events_pb2.KvEventBatch]) -> list[bytes]:
    return [e.SerializeToString() for b in batches for e in b.events]


def test_reconnect_with_last_sequence_gets_exactly_the_missed_events() -> None:
    proc, address = start_worker("--speedup-ratio", "0", "--num-gpu-blocks-override", "16")
    channel = grpc.insecure_channel(address)
    decode = decode_pb2_grpc.DecodeStub(channel)
    events = kv_events_pb2_grpc.KvEventsStub(channel)
    try:
        # A subscriber that stays connected throughout sees the reference sequence.
        steady = events.Subscribe(kv_events_pb2.SubscribeRequest(start_sequence=1))
        flaky = events.Subscribe(kv_events_pb2.SubscribeRequest(start_sequence=1))
        run_requests(decode, 0, 3)
        first_part = batches_until(flaky, _last_sequence(events))
        flaky.cancel()
        last_seen = first_part[-1].sequence

        run_requests(decode, 3, 6)  # events it misses while away; the tiny pool also evicts
        end = _last_sequence(events)
        assert end > last_seen
        again = events.Subscribe(kv_events_pb2.SubscribeRequest(start_sequence=last_seen + 1))
        missed = batches_until(again, end)
        again.cancel()
        reference = batches_until(steady, end)
        steady.cancel()

        got = first_part + missed
        # A message may carry several steps (first_sequence..sequence): together they cover
        # every step once, in order, with the same events as the steady subscriber's.
        assert [n for b in got for n in steps(b)] == list(range(1, end + 1))
        assert [n for b in reference for n in steps(b)] == list(range(1, end + 1))
        assert events_of(got) == events_of(reference)
        kinds = {e.WhichOneof("kind") for b in got for e in b.events}
        assert {"stored", "removed"} <= kinds
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        channel.close()


def test_too_old_sequence_gets_a_resync_snapshot() -> None:
    proc, address = start_worker("--speedup-ratio", "0", "--kv-event-buffer", "2")
    channel = grpc.insecure_channel(address)
    try:
        run_requests(decode_pb2_grpc.DecodeStub(channel), 0, 5)
        call = kv_events_pb2_grpc.KvEventsStub(channel).Subscribe(
            kv_events_pb2.SubscribeRequest(start_sequence=1))
        first = next(call)
        call.cancel()
        assert first.WhichOneof("payload") == "resync"
        assert first.resync.sequence >= 5 and len(first.resync.blocks) > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        channel.close()


def _last_sequence(events: kv_events_pb2_grpc.KvEventsStub) -> int:
    """The worker's newest sequence number, from a fresh subscription's resync snapshot."""
    call = events.Subscribe(kv_events_pb2.SubscribeRequest())
    try:
        first = next(call)
        assert first.WhichOneof("payload") == "resync"
        return first.resync.sequence
    finally:
        call.cancel()
