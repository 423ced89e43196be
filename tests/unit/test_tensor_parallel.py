"""Tensor parallelism of the reference engine on the CPU (gloo between real processes, one per
rank): greedy tokens equal transformers' `generate` and the one-rank engine's for dense and MoE
families, also through chunked prefill, prefix-cache hits, preemption and the host KV tier;
each rank holds its shard (its heads, its KV heads, a replicated KV head when there are fewer KV
heads than ranks); a model the rank count does not divide is refused with no rank left behind,
and so is a KV handle from a worker of another rank count."""
from __future__ import annotations

import multiprocessing
import pathlib

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.reference.parallel.group import TensorGroup
from tandem.engines.reference.parallel.mirror import Mirror
from tandem.engines.reference.parallel.transfer import RankedTransfer
from tandem.engines.types import KvHandle, KvLayout
from tandem.errors import InvalidRequest
from tandem.kv.transfer import SimulatedTransfer, TransferError
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_engine import hf_greedy, prompts, run
from tests.unit.test_reference_host_tier import HOST_BYTES, check_all_free, drain, step_until_idle

FAMILIES = ["llama", "llama3", "qwen3", "mixtral", "qwen3_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny-tp")
    return {f: write_tiny_model(root / f, f, seed=3) for f in FAMILIES}


def engine_for(model_dir: pathlib.Path, tp: int, **overrides: object) -> ReferenceEngine:
    args = EngineArgs(model=str(model_dir), device="cpu", kv_block_size=8,
                      num_gpu_blocks=overrides.pop("num_gpu_blocks", 256),
                      tensor_parallel_size=tp, **overrides)
    engine = create_reference_engine(args)
    assert isinstance(engine, ReferenceEngine)
    return engine


@pytest.mark.parametrize("family", FAMILIES)
async def test_two_ranks_give_the_tokens_of_transformers_and_of_one_rank(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs[family]
    single = engine_for(model_dir, 1)
    await single.start()
    try:
        batch = prompts(single.vocab_size, [3, 17, 40, 9])
        alone = await run(single, batch)
    finally:
        await single.close()
    engine = engine_for(model_dir, 2)
    await engine.start()
    try:
        spec = engine.model.spec
        assert spec.num_heads == single.model.spec.num_heads // 2  # each rank its heads
        assert engine.kv_cache.shape[4] == single.kv_cache.shape[4] // 2  # and its KV heads
        results = await run(engine, batch)
        for prompt, (tokens, _), (one_rank, _) in zip(batch, results, alone, strict=True):
            assert tokens == one_rank == hf_greedy(model_dir, prompt)
        assert engine.pool.num_used == 0
    finally:
        await engine.close()
    assert not multiprocessing.active_children()  # the follower stopped with the engine


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
async def test_chunks_preemption_and_prefix_hits_at_two_ranks(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs[family]
    # A 12-block pool and 12-token steps: three prompts of ~4 blocks are chunked, fill the
    # pool and need a fifth block each, so one is preempted and recomputed.
    engine = engine_for(model_dir, 2, num_gpu_blocks=12, max_num_tokens=12)
    await engine.start()
    try:
        batch = prompts(engine.vocab_size, [30, 31, 29], seed=5)
        for prompt, (tokens, _) in zip(batch, await run(engine, batch), strict=True):
            assert tokens == hf_greedy(model_dir, prompt)
        assert engine.scheduler.num_preemptions > 0
        shared = prompts(engine.vocab_size, [40], seed=2)[0]
        for n, seed in ((5, 3), (6, 4), (11, 6)):
            prompt = prompts(engine.vocab_size, [n], seed=seed, prefix=shared)
            (tokens, usage), = await run(engine, prompt)
            assert tokens == hf_greedy(model_dir, prompt[0])
        assert usage.cached_tokens == 40  # five full blocks of 8, computed by both ranks
        assert engine.pool.num_used == 0
    finally:
        await engine.close()


async def test_fewer_kv_heads_than_ranks_replicates_them(
        model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs["llama"]  # 4 query heads, 2 KV heads
    engine = engine_for(model_dir, 4)
    await engine.start()
    try:
        assert engine.model.spec.num_heads == 1
        assert engine.kv_cache.shape[4] == 1  # the one KV head its query head reads
        batch = prompts(engine.vocab_size, [12, 25], seed=9)
        for prompt, (tokens, _) in zip(batch, await run(engine, batch), strict=True):
            assert tokens == hf_greedy(model_dir, prompt)
    finally:
        await engine.close()


async def test_the_host_tier_copies_every_ranks_blocks(
        model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs["qwen3"]
    # 10 device blocks hold one 40-token prompt and its output: two fillers evict the first
    # prompt's blocks to the host tier, and its second turn reads all of them back.
    engine = engine_for(model_dir, 2, num_gpu_blocks=10, max_num_tokens=12,
                        kv_host_cache_bytes=HOST_BYTES)
    try:
        first, *fillers = prompts(engine.vocab_size, [40, 40, 40], seed=11)
        for i, prompt in enumerate([first, *fillers]):
            streams = await step_until_idle(engine, {0: [(f"warm{i}", prompt)]})
            out, _ = await drain(streams[f"warm{i}"])
            assert out == hf_greedy(model_dir, prompt)
        follow = first + prompts(engine.vocab_size, [20], seed=12)[0]
        onboarded = engine.host_copies.num_onboard_blocks
        streams = await step_until_idle(engine, {0: [("turn2", follow)]})
        out, usage = await drain(streams["turn2"])
        assert engine.host_copies.num_onboard_blocks - onboarded == 5
        assert usage.cached_tokens == len(first)
        assert out == hf_greedy(model_dir, follow)  # rank 1's blocks came back too
        check_all_free(engine)
    finally:
        await engine.close()


def test_a_rank_count_that_does_not_divide_the_model_is_refused(
        model_dirs: dict[str, pathlib.Path]) -> None:
    with pytest.raises(InvalidRequest, match="does not divide attention heads"):
        engine_for(model_dirs["llama"], 3)  # 4 heads
    assert not multiprocessing.active_children()


async def test_a_handle_of_another_rank_count_is_refused_before_any_read() -> None:
    ours, theirs = multiprocessing.Pipe()
    own = SimulatedTransfer(block_bytes=64, gbps=0)
    transfer = RankedTransfer(own, Mirror([ours], TensorGroup()))
    handle = KvHandle("p", "127.0.0.1:1", "r", "nixl", KvLayout("float32", 2, 1, 16, 8), 8,
                      block_ids=(0,))  # from a prefill worker of one rank
    with pytest.raises(TransferError, match="2 tensor-parallel shard|holds 2"):
        await transfer.read(handle, [3], timeout_s=5)
    assert not theirs.poll()  # no follower was asked to read
    transfer.close()


@pytest.mark.parametrize("flag", [{"pipeline_parallel_size": 2}, {"expert_parallel_size": 2},
                                  {"enable_attention_dp": True}])
def test_parallelism_the_engine_does_not_build_is_refused(
        flag: dict[str, object], model_dirs: dict[str, pathlib.Path]) -> None:
    with pytest.raises(InvalidRequest, match="not built in the reference engine") as caught:
        engine_for(model_dirs["mixtral"], 2, **flag)
    assert caught.value.param == next(iter(flag))
    assert not multiprocessing.active_children()
