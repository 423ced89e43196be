"""Disaggregation in the batching engine, on two mock engines (a prefill and a decode worker in
one process; the transfer is the mock's simulated one). Each test ends with both pools back to
their starting free blocks and no lease left."""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
from test_mock_engine import collect, prompt

from tandem.engines.args import EngineArgs
from tandem.engines.mock.engine import MockEngine, create_mock_engine
from tandem.engines.types import (
    EngineRequest,
    FinishReason,
    KvHandle,
    SamplingParams,
    TransferRecord,
)
from tandem.errors import FailedPrecondition, InvalidRequest

BS = 16
#: The mock's block is 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 2 bytes.
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 2


def req(rid: str, tokens: list[int], max_tokens: int = 6, **sampling: object) -> EngineRequest:
    return EngineRequest(rid, tuple(tokens), SamplingParams(max_tokens=max_tokens, **sampling))


@pytest.fixture
async def make_engine(tiny_model: str) -> AsyncIterator:
    engines: list[MockEngine] = []

    async def make(**overrides: object) -> MockEngine:
        options: dict[str, object] = {"speedup_ratio": 0, "num_gpu_blocks": 64, **overrides}
        args = EngineArgs(model=tiny_model, kv_block_size=BS, **options)  # type: ignore[arg-type]
        engine = create_mock_engine(args)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()


async def idle(*engines: MockEngine) -> None:
    """Waits until the engines hold no blocks, no lease and no read (bounded)."""
    for _ in range(200):
        if all(e.pool.num_used == 0 and not e.leases and not e.loads for e in engines):
            for e in engines:
                e.pool.check_invariants()
            return
        await asyncio.sleep(0.01)
    raise AssertionError([(e.pool.num_used, len(e.leases), len(e.loads)) for e in engines])


def resume(handle: KvHandle, request: EngineRequest, first) -> EngineRequest:  # noqa: ANN001
    return dataclasses.replace(request, kv_handle=handle, first_token=first)


async def test_disaggregated_tokens_equal_aggregated_and_leases_come_back(make_engine) -> None:
    prefill, decode = await make_engine(), await make_engine()
    released: list[KvHandle] = []
    decode.set_lease_releaser(lambda h: released.append(h) or prefill.leases.release(
        h.request_id))
    for n in (1, 15, 16, 17, 40):  # block-size multiples and not
        p = prompt(n, n)
        agg = await collect(decode.add_request(req(f"a{n}", p)))
        result = await prefill.prefill(req(f"d{n}", p), lease_ms=30_000)
        assert result.kv_handle is not None and result.finish_reason is None
        handle = result.kv_handle
        assert handle.backend == "mock" and handle.num_tokens == n
        assert len(handle.block_ids) == prefill.pool.blocks_for(n)
        assert len(prefill.leases) == 1 and prefill.pool.num_used == len(handle.block_ids)
        out = await collect(decode.add_request(resume(handle, req(f"d{n}", p),
                                                      result.first_token)))
        assert out.tokens == agg.tokens and out.finish == FinishReason.LENGTH
        assert released[-1].request_id == f"d{n}"
        await idle(prefill, decode)
    stats = decode.stats()
    assert stats.kv_transfers_ok == 5
    assert stats.kv_bytes_received == sum(-(-n // BS) for n in (1, 15, 16, 17, 40)) * BLOCK_BYTES


async def test_a_repeated_prompt_hits_the_prefill_cache(make_engine) -> None:
    prefill = await make_engine()
    p = prompt(0, 40)
    first = await prefill.prefill(req("a", p), lease_ms=30_000)
    await prefill.release("a")
    again = await prefill.prefill(req("b", p), lease_ms=30_000)
    assert (first.cached_tokens, again.cached_tokens) == (0, 32)
    assert again.first_token == first.first_token
    assert await prefill.release("b") and not await prefill.release("b")
    await idle(prefill)


async def test_an_expired_lease_frees_its_blocks(make_engine) -> None:
    prefill = await make_engine()
    result = await prefill.prefill(req("a", prompt(0, 40)), lease_ms=50)
    assert result.kv_handle is not None and prefill.pool.num_used == 3
    await idle(prefill)
    assert prefill.stats().kv_lease_expiries == 1
    assert not await prefill.release("a")


async def test_a_stop_token_first_finishes_at_prefill_without_a_lease(make_engine) -> None:
    prefill = await make_engine()
    p = prompt(3, 20)
    plain = await prefill.prefill(req("a", p), lease_ms=30_000)
    await prefill.release("a")
    stopped = await prefill.prefill(req("b", p, stop_token_ids=(plain.first_token.token_id,)),
                                    lease_ms=30_000)
    assert stopped.kv_handle is None and stopped.finish_reason == FinishReason.STOP
    one = await prefill.prefill(req("c", p, max_tokens=1), lease_ms=30_000)
    assert one.kv_handle is None and one.finish_reason == FinishReason.LENGTH
    await idle(prefill)


async def test_cancelling_a_prefill_leaves_nothing_pinned(make_engine) -> None:
    # Real step times and small chunks: the prompt takes several steps.
    prefill = await make_engine(speedup_ratio=1.0, max_num_tokens=64, num_gpu_blocks=200)
    task = asyncio.create_task(prefill.prefill(req("a", prompt(0, 2000), max_tokens=8),
                                               lease_ms=30_000))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await idle(prefill)


async def test_abort_during_the_read_frees_blocks_only_when_it_ends(make_engine) -> None:
    prefill = await make_engine()
    # 3 blocks at this bandwidth take about 0.3 s to "arrive".
    decode = await make_engine(mock_kv_transfer_gbps=3 * BLOCK_BYTES / 0.3 / 1e9)
    released: list[str] = []
    decode.set_lease_releaser(lambda h: released.append(h.request_id)
                              or prefill.leases.release(h.request_id))
    p = prompt(0, 40)
    result = await prefill.prefill(req("a", p), lease_ms=30_000)
    stream = decode.add_request(resume(result.kv_handle, req("a", p), result.first_token))
    for _ in range(100):
        if decode.loads:
            break
        await asyncio.sleep(0.005)
    assert decode.loads and decode.pool.num_used == 3
    assert decode.abort("a")
    assert decode.pool.num_used == 3  # still being written
    out = await collect(stream)
    assert out.finish == FinishReason.CANCELLED and out.tokens == []
    await idle(prefill, decode)
    assert released == ["a"]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_an_expired_lease_on_the_decode_side_follows_the_policy(make_engine,
                                                                      policy: str) -> None:
    prefill = await make_engine()
    decode = await make_engine(kv_load_failure_policy=policy)
    released: list[str] = []
    decode.set_lease_releaser(lambda h: released.append(h.request_id))
    p = prompt(0, 40)
    agg = await collect(decode.add_request(req("agg", p)))
    result = await prefill.prefill(req("a", p), lease_ms=30_000)
    expired = dataclasses.replace(result.kv_handle,
                                  lease_expiry_unix_ms=int(time.time() * 1000) - 1)
    stream = decode.add_request(resume(expired, req("a", p), result.first_token))
    if policy == "recompute":
        assert (await collect(stream)).tokens == agg.tokens
    else:
        with pytest.raises(FailedPrecondition, match="expired"):
            await collect(stream)
    assert released == ["a"]  # the decode side still tells the prefill worker
    assert decode.stats().kv_transfers_failed == 1
    await prefill.release("a")
    await idle(prefill, decode)


async def test_leases_filling_the_pool_make_new_prompts_wait_not_fail(make_engine) -> None:
    prefill = await make_engine(num_gpu_blocks=5)
    await prefill.prefill(req("a", prompt(0, 70)), lease_ms=200)  # holds all 5 blocks
    assert prefill.pool.num_free == 0
    started = time.monotonic()
    out = await collect(prefill.add_request(req("b", prompt(100, 40))))
    assert out.finish == FinishReason.LENGTH and time.monotonic() - started >= 0.1
    await idle(prefill)


async def test_bad_handles_are_refused_before_anything_is_allocated(make_engine) -> None:
    prefill, decode = await make_engine(), await make_engine()
    p = prompt(0, 40)
    result = await prefill.prefill(req("a", p), lease_ms=30_000)
    handle = result.kv_handle
    with pytest.raises(FailedPrecondition, match="blocks"):
        decode.add_request(resume(dataclasses.replace(handle, block_ids=(1,)), req("b", p),
                                  result.first_token))
    with pytest.raises(FailedPrecondition, match="covers"):
        decode.add_request(resume(handle, req("c", p[:-1]), result.first_token))
    with pytest.raises(InvalidRequest, match="KV handle"):
        await prefill.prefill(resume(handle, req("d", p), result.first_token), 1000)
    await prefill.release("a")
    await idle(prefill, decode)


async def test_the_transfer_observer_runs_in_the_admitting_calls_context(make_engine) -> None:
    """The read runs in an engine task, yet its observer sees the context of the call that
    admitted the request (its trace span, its request id), and a record per read."""
    prefill, decode = await make_engine(), await make_engine()
    decode.set_lease_releaser(lambda h: prefill.leases.release(h.request_id))
    caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="engine")
    seen: list[tuple[str, TransferRecord]] = []
    decode.set_transfer_observer(lambda record: seen.append((caller.get(), record)))
    p = prompt(3, 40)  # 3 blocks, the last partial
    result = await prefill.prefill(req("t", p), lease_ms=30_000)
    assert result.kv_handle is not None

    async def serve() -> None:  # as a servicer's own task would
        caller.set("servicer of t")
        await collect(decode.add_request(resume(result.kv_handle, req("t", p),
                                                result.first_token)))

    await asyncio.create_task(serve())
    ((context, record),) = seen
    assert context == "servicer of t"
    assert record.request_id == "t" and record.error is None
    assert record.num_bytes == 3 * BLOCK_BYTES and record.duration_s >= 0
    assert record.source_worker_id == result.kv_handle.worker_id
    await idle(prefill, decode)


async def test_a_prefill_reusing_a_leased_request_id_is_refused(make_engine) -> None:
    """A request id whose lease is still held is refused at admission (seen by the gRPC fuzz:
    the second lease used to fail the whole step loop); the engine serves on."""
    pre = await make_engine()
    first = await pre.prefill(req("same", [5, 6, 7, 8, 9]), lease_ms=60_000)
    assert first.kv_handle is not None
    with pytest.raises(InvalidRequest, match="still holds the KV lease") as info:
        await pre.prefill(req("same", [5, 6, 7]), lease_ms=60_000)
    assert info.value.param == "request_id"
    assert await pre.release("same")
    again = await pre.prefill(req("same", [5, 6, 7]), lease_ms=60_000)
    assert again.kv_handle is not None and await pre.release("same")
    await idle(pre)
