"""A request that fell behind its decode session gets everything queued as one chunk, in order."""
from __future__ import annotations

import collections

from tandem.engines.types import FinishReason
from tandem.runtime.clients import _chunk_from_pb
from tandem.runtime.decode_session import _merged
from tandem.v1 import common_pb2, decode_pb2


def test_queued_chunks_join_in_order_with_the_last_finish() -> None:
    queued = collections.deque([
        (decode_pb2.GenerateChunk(token_ids=[1, 2], cached_tokens=32), 0),
        (decode_pb2.GenerateChunk(token_ids=[3]), 555),
        (decode_pb2.GenerateChunk(token_ids=[4, 5], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                  usage=common_pb2.Usage(prompt_tokens=7, completion_tokens=5)),
         777),
    ])
    chunk = _merged(queued, _chunk_from_pb)
    assert not queued
    assert chunk.token_ids == [1, 2, 3, 4, 5]
    assert chunk.cached_tokens == 32
    assert chunk.finish_reason == FinishReason.LENGTH
    assert chunk.usage is not None and chunk.usage.completion_tokens == 5
    assert chunk.received_ns == 555  # the first measured read among them


def test_one_queued_chunk_is_itself() -> None:
    queued = collections.deque([(decode_pb2.GenerateChunk(token_ids=[9]), 42)])
    chunk = _merged(queued, _chunk_from_pb)
    assert (chunk.token_ids, chunk.finish_reason, chunk.received_ns) == ([9], None, 42)
