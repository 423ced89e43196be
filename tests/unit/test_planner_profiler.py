"""`tandem profile` (tandem.planner.profiler, tandem.planner.measure): the measurement rules on
fake workers, then real mock-engine workers profiled into files that read_profile loads, with
latency rising where the mock's timing model says it must (TTFT with the offered load, ITL with
the batch and, through the KV in use, with the context)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
from collections.abc import AsyncGenerator, Iterator

import pytest

from tandem.engines.types import EngineRequest
from tandem.errors import InvalidRequest, Overloaded
from tandem.planner import measure
from tandem.planner.profile import read_profile
from tandem.planner.profiler import QUICK, ProfilerConfig, main, profile, started_worker

#: The mock at twice real speed, with a KV pool small enough (1,280 blocks of 32 tokens) that
#: 32 streams of 1,024 tokens use most of it: its decode time grows with the KV in use.
MOCK_FLAGS = ["--speedup-ratio", "2", "--num-gpu-blocks-override", "1280"]


# ---- the measurement rules, on fakes --------------------------------------------------------

def test_p90_interpolates_and_prompts_never_share_a_prefix() -> None:
    assert measure.p90([float(v) for v in range(1, 11)]) == pytest.approx(9.1)
    assert measure.p90([5.0]) == 5.0
    with pytest.raises(ValueError):
        measure.p90([])
    prompts = measure.Prompts(seed=1)
    requests = [prompts.request(64, 1) for _ in range(50)]
    assert len({r.request_id for r in requests}) == 50
    assert all(len(r.prompt_token_ids) == 64 for r in requests)
    assert all(min(r.prompt_token_ids) >= 16 for r in requests)
    # Two prompts that start alike would share a cached first block; a sampled first token
    # repeating is fine, whole equal first blocks (32 tokens) are not.
    assert len({r.prompt_token_ids[:32] for r in requests}) == 50
    assert measure.requests_for(100.0, 10, 5, 1.0) == 10
    assert measure.requests_for(1.0, 10, 5, 1.0) == 5
    assert measure.requests_for(1e9, 10, 5, 1.0) == 40


async def test_a_prefill_run_offers_its_rate_and_counts_refusals() -> None:
    sent: list[EngineRequest] = []

    async def first_token(request: EngineRequest) -> None:
        sent.append(request)
        if len(sent) % 4 == 0:
            raise Overloaded("queue full")
        await asyncio.sleep(0.002)

    loop = asyncio.get_running_loop()
    start = loop.time()
    run = await measure.prefill_run(first_token, measure.Prompts(0), 100, 20000.0, 20, seed=3)
    elapsed = loop.time() - start
    assert (run.num_requests, run.num_refused) == (20, 5)
    assert all(r.sampling.max_tokens == 1 and len(r.prompt_token_ids) == 100 for r in sent)
    # 200 requests/s: 19 exponential gaps of 5 ms on average.
    assert 0.03 < elapsed < 0.5
    assert run.ttft_ms >= 2.0


async def test_a_decode_run_counts_only_the_window_where_every_stream_decodes() -> None:
    """Stream 1's first token comes 40 ms after stream 0's (say, its KV was evicted); until then
    stream 0 decodes alone at 10 ms a token, then both at 1 ms. The early gaps are a fifth of
    all gaps, so counted they would make the p90 10 ms; the steady window leaves them out."""
    started: list[int] = []
    cached: list[tuple[int, ...]] = []

    async def stream(request: EngineRequest) -> AsyncGenerator[int, None]:
        if request.sampling.max_tokens == 1:  # each prompt runs once first, for its cache
            cached.append(request.prompt_token_ids)
            yield 1
            return
        assert request.prompt_token_ids in cached
        i = len(started)
        started.append(i)
        await asyncio.sleep(0.040 * i)
        yield 1
        for step in range(request.sampling.max_tokens - 1):
            await asyncio.sleep(0.010 if i == 0 and step < 4 else 0.001)
            yield 1

    run = await measure.decode_run(stream, measure.Prompts(0), context_length=110,
                                   batch_size=2, osl=20)
    assert (run.context_length, run.batch_size) == (110, 2) and len(cached) == 2
    assert run.itl_ms < 6.0
    assert run.num_samples < 2 * 19 - 4
    with pytest.raises(ValueError, match="context_length"):
        await measure.decode_run(stream, measure.Prompts(0), 10, 1, 40)


def test_config_checks_and_the_preset_lists_it_replaces() -> None:
    config = ProfilerConfig(quick=True, batch_sizes=[16, 2, 2])
    sweep = config.sweep()
    assert sweep.batch_sizes == (2, 16) and sweep.isls == QUICK.isls
    with pytest.raises(InvalidRequest, match="role"):
        ProfilerConfig(role="encode")
    with pytest.raises(InvalidRequest, match="isls"):
        ProfilerConfig(isls=[0])


# ---- real mock workers ----------------------------------------------------------------------

@pytest.fixture
def restored_logging() -> Iterator[None]:
    """main() sets up this process's logging as a command does; the next tests get it back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_quick_profile_of_the_mock_engine(tmp_path: pathlib.Path,
                                          restored_logging: None) -> None:
    out = tmp_path / "agg.json"
    assert main(["--quick", "--output", str(out), "--log-level", "warning", "--",
                 *MOCK_FLAGS]) == 0
    profile = read_profile(out)
    assert (profile.engine, profile.model, profile.gpus_per_worker) == ("mock", "tandem-demo", 1)
    assert {p.isl for p in profile.prefill} == set(QUICK.isls)
    assert len(profile.prefill) == len(QUICK.isls) * len(QUICK.load_fractions)
    assert {(p.context_length, p.batch_size) for p in profile.decode} == {
        (c, b) for c in QUICK.context_lengths for b in QUICK.batch_sizes}
    for isl in QUICK.isls:
        curve = sorted((p.tokens_per_s, p.ttft_ms) for p in profile.prefill if p.isl == isl)
        # Past saturation (the last load) prompts queue: TTFT above the lightest load's.
        assert curve[-1][1] > curve[0][1], (isl, curve)
    itl = {(p.context_length, p.batch_size): p.itl_ms for p in profile.decode}
    small, large = min(QUICK.batch_sizes), max(QUICK.batch_sizes)
    for context in QUICK.context_lengths:
        assert itl[context, large] > itl[context, small], itl
    # The same batch holds more KV at a longer context; the mock's step time grows with it.
    assert itl[max(QUICK.context_lengths), large] > itl[min(QUICK.context_lengths), large]
    # The planner can read capacities off it.
    isl = max(QUICK.isls)
    assert profile.max_prefill_tokens_per_s(isl, 1e6) == max(
        p.tokens_per_s for p in profile.prefill if p.isl == isl)
    assert profile.max_decode_streams(min(QUICK.context_lengths), 1e6) == large


async def test_profile_a_running_prefill_worker(tmp_path: pathlib.Path) -> None:
    config = ProfilerConfig(role="prefill", quick=True, isls=[256], load_fractions=[0.3, 1.2],
                            output=str(tmp_path / "prefill.json"), model="demo")
    async with started_worker(config, MOCK_FLAGS) as address:
        measured = await profile(dataclasses.replace(config, address=address))
    loaded = read_profile(config.output)
    assert loaded == measured and loaded.model == "demo" and not loaded.decode
    assert [p.isl for p in loaded.prefill] == [256, 256]
    with pytest.raises(InvalidRequest, match="--address"):
        await profile(ProfilerConfig(address="127.0.0.1:1"), ["--speedup-ratio", "2"])
    with pytest.raises(InvalidRequest, match="context-lengths"):
        await profile(ProfilerConfig(quick=True, context_lengths=[16]))
