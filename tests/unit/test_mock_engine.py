from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.batching.scheduler import StepPlan
from tandem.engines.mock import timing
from tandem.engines.mock.engine import MockEngine, create_mock_engine
from tandem.engines.mock.sampler import TokenSampler, stream_key
from tandem.engines.registry import create_engine
from tandem.engines.stream import RequestStream
from tandem.engines.types import (
    BlockStored,
    EngineRequest,
    FinishReason,
    KvHandle,
    KvLayout,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from tandem.errors import FailedPrecondition, InvalidRequest, Overloaded, Unavailable
from tandem.kv.event_log import EventLog
from tandem.kv.hashing import block_hashes

SPECIAL_IDS = {0, 1, 2, 3}  # written by conftest's tiny_model; 2 is EOS
BS = 16


@dataclasses.dataclass
class Result:
    tokens: list[int]
    logprobs: list[TokenLogprob]
    finish: FinishReason | None
    usage: Usage | None


async def collect(stream: RequestStream) -> Result:
    out = Result([], [], None, None)
    async for chunk in stream:
        out.tokens += chunk.token_ids
        out.logprobs += chunk.logprobs
        out.finish, out.usage = chunk.finish_reason, chunk.usage
    return out


def req(rid: str, prompt: list[int] | tuple[int, ...], max_tokens: int = 8, **sampling: object
        ) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **sampling))


def prompt(start: int, n: int) -> list[int]:
    return [4 + (start + i) % 990 for i in range(n)]


@pytest.fixture
async def make_engine(tiny_model: str) -> AsyncIterator:
    engines: list[MockEngine] = []

    async def make(start: bool = True, **overrides: object) -> MockEngine:
        args = EngineArgs(**{"model": tiny_model, "kv_block_size": BS, "speedup_ratio": 0,
                             **overrides})  # type: ignore[arg-type]
        engine = create_mock_engine(args)
        if start:
            await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()


def record_plans(engine: MockEngine) -> list[tuple[StepPlan, int]]:
    """Wraps the scheduler so each step's plan and running count are kept."""
    plans: list[tuple[StepPlan, int]] = []
    schedule = engine.scheduler.schedule

    def recording() -> StepPlan:
        plan = schedule()
        plans.append((plan, len(engine.scheduler.running)))
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


# ---- timing model -------------------------------------------------------------------------

def test_timing_formulas() -> None:
    assert timing.prefill_ms(1000) == pytest.approx(32.1058589)
    assert timing.prefill_ms(1) == pytest.approx(4.209989e-7 + 1.518344e-2 + 16.50142)
    assert timing.prefill_ms(0) == 0.0
    assert timing.decode_ms(0.0) == pytest.approx(5.74)
    assert timing.decode_ms(0.5) == pytest.approx(26.31)
    assert timing.decode_ms(1.0) == pytest.approx(34.01)
    assert timing.decode_ms(3.0) == 1.0  # floored


def test_step_seconds_adds_prefill_and_decode_and_divides_by_speedup() -> None:
    capacity = 1000
    both = timing.prefill_ms(500) + timing.decode_ms(0.25)
    assert timing.step_seconds(500, 250, capacity, 1.0) == pytest.approx(both / 1000)
    assert timing.step_seconds(500, 250, capacity, 10.0) == pytest.approx(both / 10_000)
    assert timing.step_seconds(500, None, capacity, 1.0) == pytest.approx(
        timing.prefill_ms(500) / 1000)
    assert timing.step_seconds(0, 250, capacity, 2.0) == pytest.approx(
        timing.decode_ms(.25) / 2000)
    assert timing.step_seconds(0, 5000, capacity, 1.0) == pytest.approx(  # u capped at 1
        timing.decode_ms(1.0) / 1000)
    for no_delay in (0.0, 1e6, 1e9):
        assert timing.step_seconds(500, 250, capacity, no_delay) == 0.0


def test_dynamo_161_figures_at_concurrency_1() -> None:
    """Dynamo 1.6.1's own simulator (aisimulate-core 0.13.0, offline replay) gives TTFT
    19.554948 ms and mean ITL 5.755450 ms for ISL/OSL 200/200 at defaults (16384 blocks of 64)."""
    capacity = 16384 * 64
    assert timing.step_seconds(200, None, capacity, 1.0) * 1000 == pytest.approx(19.554948)
    itls = [timing.step_seconds(0, 200 + k, capacity, 1.0) * 1000 for k in range(1, 200)]
    assert sum(itls) / len(itls) == pytest.approx(5.755450, abs=1e-6)


@pytest.mark.parametrize("block_size", [16, 32, 64])
async def test_default_pool_holds_dynamos_default_capacity(make_engine, block_size: int) -> None:
    # Dynamo 1.6.1's mocker: 16384 blocks of 64 tokens; a pass's decode time depends on the
    # share of that capacity in use, so Tandem's pool holds the same tokens at any block size.
    engine = await make_engine(kv_block_size=block_size)
    assert engine.pool.total * engine.pool.block_size == 16384 * 64


async def test_engine_times_each_step_as_dynamo_does(make_engine, monkeypatch) -> None:
    calls: list[tuple[int, int | None, int]] = []

    def record(prefill_tokens: int, decode_tokens: int | None, capacity: int,
               speedup: float) -> float:
        calls.append((prefill_tokens, decode_tokens, capacity))
        return 0.0

    monkeypatch.setattr(timing, "step_seconds", record)
    engine = await make_engine(num_gpu_blocks=100, max_num_tokens=64)
    capacity = 100 * engine.pool.block_size
    await collect(engine.add_request(req("a", prompt(0, 100), max_tokens=3)))
    # 100 prompt tokens in chunks of 64 + 36 (the first token comes out of the second chunk's
    # pass, with no decode charge), then two decode passes over sequences of 101 and 102 tokens.
    assert calls == [(64, None, capacity), (36, None, capacity), (0, 101, capacity),
                     (0, 102, capacity)]


# ---- validation ---------------------------------------------------------------------------

async def test_invalid_requests_are_refused_with_the_field_at_fault(make_engine) -> None:
    engine = await make_engine(max_seq_len=256)
    cases = [
        (req("a", []), "prompt_token_ids", "empty"),
        (req("a", [5, 1000]), "prompt_token_ids", "1000"),
        (req("a", [5, -1]), "prompt_token_ids", "-1"),
        (req("a", [5], max_tokens=0), "max_tokens", "at least 1"),
        (req("a", prompt(0, 200), max_tokens=57), "max_tokens", "256"),
        (req("a", [5], top_logprobs=21), "top_logprobs", "20"),
    ]
    for request, param, text in cases:
        with pytest.raises(InvalidRequest) as err:
            engine.add_request(request)
        assert err.value.param == param and text in err.value.message
    engine.add_request(req("a", prompt(0, 200), max_tokens=56))  # exactly max_seq_len: fine
    with pytest.raises(InvalidRequest, match="already in flight"):
        engine.add_request(req("a", [5]))


async def test_a_request_larger_than_the_kv_pool_is_refused(make_engine) -> None:
    engine = await make_engine(num_gpu_blocks=4)
    with pytest.raises(InvalidRequest, match="KV blocks"):
        engine.add_request(req("a", prompt(0, 60), max_tokens=5))


async def test_full_waiting_queue_is_overloaded(make_engine) -> None:
    engine = await make_engine(start=False, max_queued_requests=2)
    engine.add_request(req("a", [5]))
    engine.add_request(req("b", [5]))
    with pytest.raises(Overloaded):
        engine.add_request(req("c", [5]))


def mock_handle(engine: MockEngine, n: int, **changes: object) -> KvHandle:
    handle = KvHandle("w0", "127.0.0.1:1", "p", "mock", engine.layout, n,
                      block_ids=tuple(range(engine.pool.blocks_for(n))),
                      lease_expiry_unix_ms=int(time.time() * 1000) + 30_000)
    return dataclasses.replace(handle, **changes)


async def test_kv_handles_must_match_layout_and_backend(make_engine) -> None:
    engine = await make_engine()
    first = TokenLogprob(42, -0.1)
    p = prompt(0, 20)
    other = dataclasses.replace(engine.layout, dtype="float16", num_kv_heads=8)
    with pytest.raises(FailedPrecondition) as err:
        engine.add_request(dataclasses.replace(
            req("a", p), kv_handle=mock_handle(engine, 20, layout=other), first_token=first))
    assert err.value.message == engine.layout.mismatch(other)
    assert "num_kv_heads 8 != 2" in err.value.message
    with pytest.raises(FailedPrecondition, match="nixl"):
        engine.add_request(dataclasses.replace(
            req("a", p), kv_handle=mock_handle(engine, 20, backend="nixl"), first_token=first))


# ---- output -------------------------------------------------------------------------------

async def test_output_is_deterministic_and_avoids_eos_and_special_tokens(make_engine) -> None:
    a, b = await make_engine(), await make_engine(max_num_tokens=7, max_batch_size=2)
    p = prompt(5, 40)
    ra = await collect(a.add_request(req("x", p, max_tokens=300)))
    rb = await collect(b.add_request(req("y", p, max_tokens=300)))
    assert ra.tokens == rb.tokens and len(ra.tokens) == 300
    assert not set(ra.tokens) & SPECIAL_IDS
    assert all(0 <= t < 1000 for t in ra.tokens)
    assert len(set(ra.tokens)) > 100  # spread over the vocabulary
    other = await collect(a.add_request(req("z", prompt(6, 40), max_tokens=300)))
    assert other.tokens != ra.tokens
    assert (ra.finish, ra.usage) == (FinishReason.LENGTH, Usage(40, 300, 0))


async def test_seed_decides_the_tokens_when_given(make_engine) -> None:
    engine = await make_engine()
    r1 = await collect(engine.add_request(req("a", prompt(0, 10), seed=7)))
    r2 = await collect(engine.add_request(req("b", prompt(50, 30), seed=7)))
    r3 = await collect(engine.add_request(req("c", prompt(0, 10), seed=8)))
    assert r1.tokens == r2.tokens != r3.tokens


async def test_stop_token_ids_respect_min_tokens(make_engine) -> None:
    engine = await make_engine()
    p = prompt(0, 12)
    key = stream_key(p, None)
    stop = engine.sampler.draw(key, 3)
    r = await collect(engine.add_request(req("a", p, max_tokens=50, stop_token_ids=(stop,))))
    assert r.finish == FinishReason.STOP and r.tokens[-1] == stop and len(r.tokens) == 4
    r = await collect(engine.add_request(
        req("b", p, max_tokens=6, stop_token_ids=(stop,), min_tokens=5)))
    assert r.finish == FinishReason.LENGTH and len(r.tokens) == 6 and stop in r.tokens


async def test_logprobs_are_plausible(make_engine) -> None:
    engine = await make_engine()
    r = await collect(engine.add_request(req("a", prompt(0, 12), max_tokens=40, top_logprobs=4)))
    assert [lp.token_id for lp in r.logprobs] == r.tokens
    for lp in r.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 4
        values = [t.logprob for t in lp.top]
        assert values == sorted(values, reverse=True)
        assert len({t.token_id for t in lp.top}) == 4
        if lp.logprob >= values[0]:
            assert lp.top[0].token_id == lp.token_id
        if any(t.token_id == lp.token_id for t in lp.top):
            assert next(t.logprob for t in lp.top if t.token_id == lp.token_id) == lp.logprob
    assert any(lp.top[0].token_id == lp.token_id for lp in r.logprobs)
    assert any(lp.top[0].token_id != lp.token_id for lp in r.logprobs)
    again = await collect(engine.add_request(req("b", prompt(0, 12), max_tokens=40,
                                                 top_logprobs=4)))
    assert again.logprobs == r.logprobs
    plain = await collect(engine.add_request(req("c", prompt(0, 12), max_tokens=5)))
    assert plain.logprobs == []


async def test_disaggregated_request_emits_the_first_token_first_and_skips_prefill(
        make_engine) -> None:
    engine = await make_engine()
    plans = record_plans(engine)
    p = prompt(0, 40)
    first = TokenLogprob(500, -0.2)
    r = await collect(engine.add_request(dataclasses.replace(
        req("a", p, max_tokens=5), kv_handle=mock_handle(engine, 40), first_token=first)))
    local = await collect(engine.add_request(req("b", p, max_tokens=5)))
    assert r.tokens[0] == 500 and len(r.tokens) == 5
    assert r.tokens[1:] == local.tokens[1:]  # same positions, same tokens
    assert r.usage == Usage(40, 5, 0)
    # The first steps read the KV and emit the prefill worker's token; none computes a prompt.
    assert plans[0][0].loads and not plans[0][0].first_tokens
    first_step = next(i for i, (plan, _) in enumerate(plans) if plan.first_tokens)
    assert all(plan.prefill_tokens == 0 for plan, _ in plans[:first_step + 1])


async def test_an_eos_first_token_stops_unless_ignore_eos(make_engine) -> None:
    engine = await make_engine()
    eos = TokenLogprob(2, -0.01)
    r = await collect(engine.add_request(dataclasses.replace(
        req("a", prompt(0, 8), max_tokens=5), kv_handle=mock_handle(engine, 8), first_token=eos)))
    assert (r.tokens, r.finish) == ([2], FinishReason.STOP)
    r = await collect(engine.add_request(dataclasses.replace(
        req("b", prompt(0, 8), max_tokens=5, ignore_eos=True, stop_token_ids=(2,)),
        kv_handle=mock_handle(engine, 8), first_token=eos)))
    assert len(r.tokens) == 5 and r.finish == FinishReason.LENGTH


# ---- scheduling ---------------------------------------------------------------------------

async def test_budgets_hold_in_every_step_with_chunked_prefill(make_engine) -> None:
    engine = await make_engine(max_num_tokens=50, max_batch_size=3)
    plans = record_plans(engine)
    streams = [engine.add_request(req(f"r{i}", prompt(i * 100, 70), max_tokens=10))
               for i in range(7)]
    results = await asyncio.gather(*map(collect, streams))
    assert all(len(r.tokens) == 10 for r in results)
    assert all(plan.num_tokens <= 50 and running <= 3 for plan, running in plans)
    assert any(plan.num_tokens == 50 for plan, _ in plans)  # the budget was binding
    assert max(running for _, running in plans) == 3
    # a 70-token prompt cannot fit one 50-token step: it was chunked
    assert any(1 < n < 70 for plan, _ in plans for _r, n in plan.scheduled)


async def test_repeated_prompt_hits_the_prefix_cache(make_engine) -> None:
    engine = await make_engine()
    p = prompt(0, 70)
    first = await collect(engine.add_request(req("a", p)))
    second = await collect(engine.add_request(req("b", p)))
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 64  # 4 full blocks; the partial one is recomputed
    assert second.tokens == first.tokens
    assert engine.stats().prefix_cache_hit_rate == pytest.approx(64 / 140)


async def test_a_fully_cached_prompt_still_computes_its_last_block(make_engine) -> None:
    engine = await make_engine()
    p = prompt(0, 32)  # exactly two blocks
    await collect(engine.add_request(req("a", p)))
    again = await collect(engine.add_request(req("b", p)))
    assert again.usage.cached_tokens == 16


async def test_the_newest_request_preempts_itself_when_it_runs_out(make_engine) -> None:
    big = await make_engine()
    tiny = await make_engine(num_gpu_blocks=8)
    # Both fit 4 blocks; the newer one (60 tokens) reaches its 5th block first, with no block
    # free and nobody newer to preempt.
    requests = [req("old", prompt(0, 50), max_tokens=40), req("new", prompt(99, 60),
                                                              max_tokens=40)]
    expected = await asyncio.gather(*(collect(big.add_request(r)) for r in requests))
    got = await asyncio.gather(*(collect(tiny.add_request(r)) for r in requests))
    assert tiny.scheduler.num_preemptions > 0
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    tiny.pool.check_invariants([])


async def test_preemption_under_a_tiny_pool_still_completes_everything(make_engine) -> None:
    big = await make_engine()
    tiny = await make_engine(num_gpu_blocks=12)  # 192 tokens; each request needs up to 112
    plans = record_plans(tiny)
    requests = [req(f"r{i}", prompt(i * 37, 40), max_tokens=72) for i in range(5)]
    expected = await asyncio.gather(*(collect(big.add_request(r)) for r in requests))
    got = await asyncio.gather(*(collect(tiny.add_request(r)) for r in requests))
    assert tiny.scheduler.num_preemptions > 0
    # as vLLM: a step that had to preempt admits nothing new
    assert all(plan.num_admitted == 0 for plan, _ in plans if plan.num_preempted)
    assert any(plan.num_preempted for plan, _ in plans)
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    assert all(g.finish == FinishReason.LENGTH for g in got)
    tiny.pool.check_invariants([])
    assert tiny.stats().kv_blocks_used == 0


async def test_abort_frees_every_block_and_finishes_cancelled(make_engine) -> None:
    engine = await make_engine()
    streams = [engine.add_request(req(f"r{i}", prompt(i * 50, 40), max_tokens=1000))
               for i in range(4)]
    chunk = await streams[0].__anext__()  # running and producing
    assert chunk.token_ids and engine.stats().kv_blocks_used > 0
    assert engine.stats().num_running == 4
    for i in range(4):
        assert engine.abort(f"r{i}")
    assert engine.stats().kv_blocks_used == 0  # freed before abort returned
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
    engine.pool.check_invariants([])
    rest = await collect(streams[0])
    assert rest.finish == FinishReason.CANCELLED
    assert rest.usage.completion_tokens == len(chunk.token_ids) + len(rest.tokens)
    assert not engine.abort("r0") and not engine.abort("never")


async def test_abort_in_the_middle_of_a_step(make_engine) -> None:
    engine = await make_engine()
    survivor = engine.add_request(req("s", prompt(0, 20), max_tokens=50))
    victim = engine.add_request(req("v", prompt(500, 20), max_tokens=50))
    await victim.__anext__()
    # The engine has scheduled its next step (victim included) and is yielding inside it.
    assert engine.abort("v")
    await collect(survivor)
    assert victim._token_ids == []  # nothing was pushed after the abort
    assert engine.stats().kv_blocks_used == 0
    engine.pool.check_invariants([])


async def test_abort_of_a_waiting_request(make_engine) -> None:
    engine = await make_engine(start=False)
    stream = engine.add_request(req("a", [5, 6]))
    assert engine.stats().num_waiting == 1 and engine.stats().pending_prefill_tokens == 2
    assert engine.abort("a")
    assert engine.stats().num_waiting == 0
    r = await collect(stream)
    assert (r.finish, r.usage) == (FinishReason.CANCELLED, Usage(2, 0, 0))


async def test_close_cancels_everything_and_refuses_new_work(make_engine) -> None:
    engine = await make_engine()
    stream = engine.add_request(req("a", prompt(0, 30), max_tokens=1000))
    await stream.__anext__()
    await engine.close()
    assert (await collect(stream)).finish == FinishReason.CANCELLED
    assert engine.stats().kv_blocks_used == 0
    with pytest.raises(Unavailable):
        engine.add_request(req("b", [5]))


async def test_a_failing_step_fails_every_stream_and_the_engine(make_engine) -> None:
    engine = await make_engine()

    def broken() -> StepPlan:
        raise RuntimeError("scheduler bug")

    engine.scheduler.schedule = broken  # type: ignore[method-assign]
    stream = engine.add_request(req("a", [5, 6]))
    with pytest.raises(RuntimeError, match="scheduler bug"):
        await collect(stream)
    with pytest.raises(Unavailable, match="scheduler bug"):
        engine.add_request(req("b", [5]))


async def test_idle_loop_does_not_spin(make_engine) -> None:
    engine = await make_engine()
    await collect(engine.add_request(req("a", [5, 6, 7], max_tokens=3)))
    steps = engine.num_steps
    for _ in range(20):
        await asyncio.sleep(0)  # give a spinning loop every chance to run
    assert engine.num_steps == steps


# ---- KV events ----------------------------------------------------------------------------

async def test_kv_events_reach_the_sink_once_per_step_and_mirror_the_cache(make_engine) -> None:
    engine = await make_engine(num_gpu_blocks=20)
    log = EventLog()
    batches: list[int] = []

    def sink(events):  # type: ignore[no-untyped-def]
        batches.append(engine.num_steps)
        log.append(events)

    engine.set_event_sink(sink)
    p = prompt(0, 40)
    r = await collect(engine.add_request(req("a", p, max_tokens=30)))
    assert len(batches) == len(set(batches))  # never two batches in one step
    # every computed full block is stored, including those filled while decoding
    computed = p + r.tokens[:-1]  # the last sampled token is never computed
    expected = block_hashes(computed, BS)
    assert len(expected) == 4
    _, blocks = log.snapshot()
    assert [b.block_hashes[0] for b in blocks] == expected
    assert blocks[0] == BlockStored((expected[0],), None, tuple(p[:16]), BS)
    # a flood of other prompts evicts them, and the log follows
    await asyncio.gather(*(collect(engine.add_request(req(f"f{i}", prompt(300 + i * 90, 150),
                                                              max_tokens=2)))
                           for i in range(4)))
    _, blocks = log.snapshot()
    cached = {h for h in engine.pool._hash_to_block}
    assert {b.block_hashes[0] for b in blocks} == cached
    assert not set(expected) <= cached


def test_registry_builds_the_mock_engine(tiny_model: str) -> None:
    engine = create_engine("mock", EngineArgs(model=tiny_model, kv_block_size=BS))
    assert isinstance(engine, MockEngine)
    assert engine.layout == KvLayout("bfloat16", 2, 2, 16, BS)
    assert engine.max_model_len == 2048
    with pytest.raises(InvalidRequest):
        create_engine("mock", EngineArgs(model=tiny_model, num_gpu_blocks=-1))


def test_batched_draws_equal_single_draws() -> None:
    # The vectorized draw (numpy's wrapping uint64) gives each (key, position) the token the
    # one-by-one draw does, keys across the whole 64-bit range included.
    sampler = TokenSampler(65_536, [0, 1, 2, 65_535])
    rng = random.Random(5)
    for count in (1, 7, 8, 128):
        keys = [rng.getrandbits(64) for _ in range(count - 1)] + [(1 << 64) - 1]
        positions = [rng.randrange(100_000) for _ in range(count)]
        assert sampler.draw_many(keys, positions) == [
            sampler.draw(k, p) for k, p in zip(keys, positions, strict=True)]


async def test_batch_wait_holds_a_burst_for_one_step_and_a_lone_request_for_the_timeout(
        make_engine) -> None:
    """--batch-wait-timeout-ms: prompts that reach an idle engine a few ms apart are prefilled
    in one step (without the hold, the first goes alone); a full batch or a step's token budget
    starts at once; a lone request starts after the timeout; running requests are never held
    up."""
    async def burst(engine: MockEngine, n: int, tag: str) -> list[Result]:
        streams = []
        for i in range(n):
            streams.append(engine.add_request(req(f"{tag}{i}", prompt(40 * i, 24), 4)))
            await asyncio.sleep(0.005)
        return list(await asyncio.gather(*(collect(s) for s in streams)))

    held = await make_engine(batch_wait_timeout_ms=2000, max_batch_size=3)
    plans = record_plans(held)
    start = time.monotonic()
    results = await burst(held, 3, "b")
    assert time.monotonic() - start < 1.5  # three fill the batch: no 2 s wait
    assert all(r.finish == FinishReason.LENGTH for r in results)
    assert plans[0][0].num_admitted == 3

    budget = await make_engine(batch_wait_timeout_ms=2000, max_num_tokens=48)
    plans = record_plans(budget)
    start = time.monotonic()
    await burst(budget, 2, "t")  # 2 x 24 prompt tokens fill a step's budget
    assert time.monotonic() - start < 1.5 and plans[0][0].num_admitted == 2

    eager = await make_engine(max_batch_size=3)  # the default: no hold
    plans = record_plans(eager)
    await burst(eager, 3, "e")
    assert plans[0][0].num_admitted == 1

    lone = await make_engine(batch_wait_timeout_ms=150)
    plans = record_plans(lone)
    start = time.monotonic()
    first = lone.add_request(req("alone", prompt(0, 24), 200))
    async for _ in first:  # its first token
        break
    assert time.monotonic() - start >= 0.14  # held for the timeout
    # It runs now: a newcomer joins at the next step instead of waiting out a timeout.
    start = time.monotonic()
    result = await collect(lone.add_request(req("joins", prompt(500, 24), 2)))
    assert result.finish == FinishReason.LENGTH and time.monotonic() - start < 0.14
    await collect(first)


def test_batch_wait_timeout_must_not_be_negative(tiny_model: str) -> None:
    with pytest.raises(InvalidRequest, match="batch_wait_timeout_ms"):
        create_engine("mock", EngineArgs(model=tiny_model, batch_wait_timeout_ms=-1))
