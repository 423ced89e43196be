"""The trtllm engine against the fake TensorRT-LLM: aggregated streaming, context-only prefill
into a KV handle, generation-only decode resuming the same tokens, EOS on the first token,
cancellation during the KV transfer (deferred abort, nothing leaked), the health canary, the
encode path, and admission errors."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.stream import RequestStream
from tandem.engines.types import EngineRequest, FinishReason, SamplingParams, TokenChunk
from tandem.errors import FailedPrecondition, InvalidRequest, Overloaded, Unavailable
from tests.unit.fake_packages import fake_trtllm  # noqa: F401 (autouse: tensorrt_llm is the fake)

TRANSCEIVER = json.dumps({"cache_transceiver_config": {"backend": "DEFAULT"}})
PROMPT = tuple(range(10, 23))  # 13 tokens: 3 full blocks of 4 and a partial one
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
EOS = 2  # tests/unit/conftest.py's tiny model




@pytest.fixture
def knobs() -> Iterator[Any]:
    from tensorrt_llm._fake.settings import knobs

    saved = dataclasses.replace(knobs)
    yield knobs
    for field in dataclasses.fields(knobs):
        setattr(knobs, field.name, getattr(saved, field.name))


@pytest.fixture
async def make(tiny_model: str) -> AsyncIterator[Any]:
    """Builds and starts trtllm engines over the tiny model (kv_block_size 4); closes them."""
    from tandem.engines.trtllm.engine import create_trtllm_engine

    made: list[Any] = []

    async def factory(**overrides: Any) -> Any:
        engine = create_trtllm_engine(EngineArgs(model=tiny_model, kv_block_size=4, **overrides))
        await engine.start()
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        await engine.close()


async def drain(stream: RequestStream) -> tuple[list[int], TokenChunk]:
    tokens: list[int] = []
    async for chunk in stream:
        tokens.extend(chunk.token_ids)
        last = chunk
    return tokens, last


def blocks_in_use(engine: Any) -> int:
    return int(engine._llm._executor.blocks.num_used)


async def until(predicate: Any, timeout_s: float = 5.0) -> None:
    """Waits for a condition the fake exposes (a readiness signal, not a guess at timing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def aggregated_tokens(make: Any, prompt: tuple[int, ...] = PROMPT,
                            sampling: SamplingParams = GREEDY) -> list[int]:
    engine = await make()
    tokens, last = await drain(engine.add_request(EngineRequest("agg", prompt, sampling)))
    assert last.finish_reason is not None
    return tokens


async def test_aggregated_streams_tokens_and_usage(make: Any) -> None:
    engine = await make()
    tokens, last = await drain(engine.add_request(EngineRequest("a", PROMPT, GREEDY)))
    assert len(tokens) == 8 and last.finish_reason is FinishReason.LENGTH
    assert last.usage is not None and (last.usage.prompt_tokens, last.usage.completion_tokens) \
        == (len(PROMPT), 8)
    assert blocks_in_use(engine) == 0  # finished: everything back in the pool (or cached)


async def test_prefill_returns_a_trtllm_handle(make: Any) -> None:
    expected = await aggregated_tokens(make)
    prefill = await make(override_engine_args=TRANSCEIVER)
    result = await prefill.prefill(EngineRequest("p", PROMPT, GREEDY), lease_ms=1000)
    handle = result.kv_handle
    assert result.finish_reason is None and result.first_token.token_id == expected[0]
    assert handle is not None and handle.backend == "trtllm"
    assert handle.layout == prefill.layout and handle.num_tokens == len(PROMPT)
    # No Tandem lease, but TensorRT-LLM frees the KV after kv_transfer_timeout_ms (30 s here).
    assert 25_000 < handle.lease_expiry_unix_ms - time.time() * 1000 <= 30_000
    from tandem.kv.hashing import block_hashes
    assert handle.block_hashes == tuple(block_hashes(PROMPT, 4))
    params = handle.trtllm_params
    assert params is not None and params.first_gen_tokens == (expected[0],)
    assert isinstance(params.opaque_state, bytes) and params.opaque_state
    assert params.disagg_request_id is not None and 1 << 40 <= params.disagg_request_id < 1 << 63
    assert params.ctx_request_id == params.disagg_request_id
    assert await prefill.release("p") is False  # no Tandem lease: the transceiver owns the KV
    assert blocks_in_use(prefill) == 3 + 1  # held for the decode worker until it pulls


async def test_decode_resumes_the_aggregated_tokens(make: Any) -> None:
    expected = await aggregated_tokens(make)
    prefill = await make(override_engine_args=TRANSCEIVER)
    decode = await make(override_engine_args=TRANSCEIVER)
    request = EngineRequest("d", PROMPT, GREEDY)
    result = await prefill.prefill(request, lease_ms=1000)
    tokens, last = await drain(decode.add_request(dataclasses.replace(
        request, kv_handle=result.kv_handle, first_token=result.first_token)))
    assert tokens == expected  # the prefill worker's first token first, then the rest
    assert last.finish_reason is FinishReason.LENGTH
    await until(lambda: blocks_in_use(prefill) == 0)  # the transfer freed the context blocks
    assert blocks_in_use(decode) == 0


async def test_eos_on_the_first_token_finishes_at_prefill(make: Any) -> None:
    from tensorrt_llm._fake import model

    prompt = next(p for p in ((i, i + 1, i + 2) for i in range(10, 100_000))
                  if model.sample(model.fold(p), 1000) == EOS)
    assert await aggregated_tokens(make, prompt) == [EOS]
    prefill = await make(override_engine_args=TRANSCEIVER)
    result = await prefill.prefill(EngineRequest("e", prompt, GREEDY), lease_ms=1000)
    assert result.finish_reason is FinishReason.STOP and result.kv_handle is None
    assert result.first_token.token_id == EOS
    assert blocks_in_use(prefill) == 0  # TensorRT-LLM sends (and holds) no KV for it


async def test_cancel_during_transfer_defers_abort_and_leaks_nothing(make: Any,
                                                                     knobs: Any) -> None:
    prefill = await make(override_engine_args=TRANSCEIVER)
    decode = await make(override_engine_args=TRANSCEIVER)
    request = EngineRequest("c", PROMPT, GREEDY)
    result = await prefill.prefill(request, lease_ms=1000)
    knobs.transfer_delay_s = 0.2
    stream = decode.add_request(dataclasses.replace(request, kv_handle=result.kv_handle,
                                                    first_token=result.first_token))
    executor = decode._llm._executor
    await until(lambda: any(r.state == "transfer" for r in executor.requests.values()))
    assert decode.abort("c") is True
    tokens, last = await drain(stream)
    assert last.finish_reason is FinishReason.CANCELLED and tokens == []  # at once
    assert decode._flights["c"].abort_pending  # TensorRT-LLM not told yet: transfer running
    assert decode.abort("c") is False
    await until(lambda: "c" not in decode._flights)  # first result came, abort sent, drained
    assert executor.leaked_blocks == 0 and blocks_in_use(decode) == 0
    assert blocks_in_use(prefill) == 0 and prefill._llm._executor.sender.num_held == 0


async def test_the_fake_leaks_when_abort_is_not_deferred(make: Any, knobs: Any) -> None:
    """The hazard the deferral avoids is real in the fake: abort mid-transfer leaks blocks on
    the decode side and leaves the context side holding its KV."""
    prefill = await make(override_engine_args=TRANSCEIVER)
    decode = await make(override_engine_args=TRANSCEIVER)
    result = await prefill.prefill(EngineRequest("n", PROMPT, GREEDY), lease_ms=1000)
    knobs.transfer_delay_s = 0.2
    from tandem.engines.trtllm import disagg
    assert result.kv_handle is not None and result.kv_handle.trtllm_params is not None
    out = decode._llm.generate_async(
        list(PROMPT), decode.api.SamplingParams(max_tokens=8, end_id=EOS), streaming=True,
        disaggregated_params=disagg.generation_only(decode.api, result.kv_handle.trtllm_params))
    executor = decode._llm._executor
    await until(lambda: any(r.state == "transfer" for r in executor.requests.values()))
    out.abort()
    async for _ in out:
        pass
    assert out.outputs[0].finish_reason == "cancelled"
    assert executor.leaked_blocks > 0 and blocks_in_use(decode) > 0
    assert prefill._llm._executor.sender.num_held == 1


async def test_cancel_after_the_first_token_aborts_at_once(make: Any, knobs: Any) -> None:
    knobs.step_s = 0.01
    engine = await make()
    stream = engine.add_request(EngineRequest("x", PROMPT, SamplingParams(max_tokens=500,
                                                                          temperature=0.0)))
    first = await stream.__anext__()
    assert first.token_ids
    assert engine.abort("x") is True
    assert not engine._flights["x"].abort_pending
    _, last = await drain(stream)
    assert last.finish_reason is FinishReason.CANCELLED
    await until(lambda: not engine._flights)
    assert blocks_in_use(engine) == 0


async def test_health_canary(make: Any, knobs: Any) -> None:
    agg = await make()
    await agg.health_canary()
    disagg_worker = await make(override_engine_args=TRANSCEIVER)
    await disagg_worker.health_canary()  # context_and_generation: no peer needed
    assert blocks_in_use(disagg_worker) == 0
    assert disagg_worker._llm._executor.sender.num_held == 0
    knobs.step_s = 1.0
    with pytest.raises(Unavailable, match="no progress"):
        await agg.health_canary(timeout_s=0.05)


async def test_stats_follow_the_engine(make: Any, knobs: Any) -> None:
    knobs.step_s = 0.005
    engine = await make()
    assert engine.stats().num_running == 0
    stream = engine.add_request(EngineRequest("s", PROMPT, SamplingParams(max_tokens=400,
                                                                          temperature=0.0)))
    await until(lambda: engine.stats().num_running == 1 and engine.stats().kv_blocks_used > 0)
    stats = engine.stats()
    assert stats.kv_blocks_total == 512 and stats.num_waiting == 0
    engine.abort("s")
    await drain(stream)
    await until(lambda: not engine._flights)
    idle = engine.stats()  # TensorRT-LLM's last report still says busy; in-flight count wins
    assert (idle.num_running, idle.num_waiting, idle.kv_blocks_used) == (0, 0, 0)


async def test_encode_materializes_embeddings(make: Any) -> None:
    import torch

    encoder = await make(encode_only=True)
    image = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
    [embedding] = await encoder.encode([image])
    assert embedding.shape == (4, 64) and embedding.dtype == "bfloat16"
    assert isinstance(embedding.data, bytes) and len(embedding.data) == 4 * 64 * 2
    from tensorrt_llm._torch.shared_tensor import _registry
    produced = list(_registry.values())[-1]
    received = torch.frombuffer(bytearray(embedding.data), dtype=torch.bfloat16).reshape(4, 64)
    assert torch.equal(received, produced)
    assert embedding.content_hash == (await encoder.encode([image]))[0].content_hash
    with pytest.raises(InvalidRequest):
        await encoder.encode([b""])
    await encoder.health_canary()  # a no-op on encode workers


async def test_admission_errors(make: Any) -> None:
    agg = await make()
    with pytest.raises(FailedPrecondition, match="cache transceiver"):
        await agg.prefill(EngineRequest("p", PROMPT, GREEDY), lease_ms=1000)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        agg.add_request(EngineRequest("v", (1, 5000), GREEDY))
    with pytest.raises(InvalidRequest, match="maximum context length"):
        agg.add_request(EngineRequest("l", PROMPT, SamplingParams(max_tokens=4000)))
    with pytest.raises(InvalidRequest, match="prompt logprobs"):
        agg.add_request(EngineRequest("q", PROMPT, SamplingParams(max_tokens=2,
                                                                  prompt_logprobs=1)))
    prefill = await make(override_engine_args=TRANSCEIVER)
    result = await prefill.prefill(EngineRequest("h", PROMPT, GREEDY), lease_ms=1000)
    assert result.kv_handle is not None
    request = EngineRequest("h", PROMPT, GREEDY, kv_handle=result.kv_handle,
                            first_token=result.first_token)
    for bad in (dataclasses.replace(result.kv_handle, backend="nixl"),
                dataclasses.replace(result.kv_handle, layout=dataclasses.replace(
                    result.kv_handle.layout, block_size=8))):
        with pytest.raises(FailedPrecondition):
            agg.add_request(dataclasses.replace(request, kv_handle=bad))
    stream = agg.add_request(EngineRequest("dup", PROMPT, GREEDY))
    with pytest.raises(InvalidRequest, match="already in flight"):
        agg.add_request(EngineRequest("dup", PROMPT, GREEDY))
    await drain(stream)


async def test_overload_and_closed(make: Any, knobs: Any) -> None:
    knobs.step_s = 0.01
    engine = await make(max_batch_size=1, max_queued_requests=1)
    streams = [engine.add_request(EngineRequest(f"o{i}", PROMPT, GREEDY)) for i in range(2)]
    with pytest.raises(Overloaded):
        engine.add_request(EngineRequest("o2", PROMPT, GREEDY))
    await engine.close()
    for stream in streams:
        _, last = await drain(stream)
        assert last.finish_reason is FinishReason.CANCELLED
    with pytest.raises(Unavailable, match="closed"):
        engine.add_request(EngineRequest("late", PROMPT, GREEDY))


async def test_logprobs_come_through(make: Any) -> None:
    engine = await make()
    sampling = SamplingParams(max_tokens=3, temperature=0.0, top_logprobs=2)
    stream = engine.add_request(EngineRequest("lp", PROMPT, sampling))
    logprobs = []
    async for chunk in stream:
        logprobs.extend(chunk.logprobs)
    assert len(logprobs) == 3
    assert all(lp.top[0].token_id == lp.token_id and len(lp.top) == 2 for lp in logprobs)


async def test_decode_logprobs_start_with_the_prefill_workers(make: Any) -> None:
    sampling = SamplingParams(max_tokens=4, temperature=0.0, top_logprobs=1)
    prefill = await make(override_engine_args=TRANSCEIVER)
    decode = await make(override_engine_args=TRANSCEIVER)
    request = EngineRequest("dl", PROMPT, sampling)
    result = await prefill.prefill(request, lease_ms=1000)
    stream = decode.add_request(dataclasses.replace(request, kv_handle=result.kv_handle,
                                                    first_token=result.first_token))
    tokens, logprobs = [], []
    async for chunk in stream:
        tokens.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
    assert [lp.token_id for lp in logprobs] == tokens and len(tokens) == 4
    assert logprobs[0] == result.first_token
    assert all(lp.top and lp.top[0].token_id == lp.token_id for lp in logprobs)


async def test_abort_during_prefill_raises_cancelled(make: Any, knobs: Any) -> None:
    from tandem.errors import Cancelled

    knobs.step_s = 0.05
    prefill = await make(override_engine_args=TRANSCEIVER)
    task = asyncio.create_task(prefill.prefill(EngineRequest("pa", PROMPT, GREEDY), 1000))
    await until(lambda: "pa" in prefill._prefills)
    assert prefill.abort("pa") is True
    with pytest.raises(Cancelled):
        await task
    assert blocks_in_use(prefill) == 0 and prefill._llm._executor.sender.num_held == 0


async def test_prefill_of_one_token_needs_no_decode_leg(make: Any) -> None:
    expected = await aggregated_tokens(make)
    prefill = await make(override_engine_args=TRANSCEIVER)
    result = await prefill.prefill(EngineRequest("one", PROMPT, SamplingParams(
        max_tokens=1, temperature=0.0)), lease_ms=1000)
    assert result.kv_handle is None and result.finish_reason is FinishReason.LENGTH
    assert result.first_token.token_id == expected[0]
    assert blocks_in_use(prefill) == 0 and prefill._llm._executor.sender.num_held == 0
