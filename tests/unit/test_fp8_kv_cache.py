"""--kv-cache-dtype fp8 in the reference engine on the CPU: the pool holds e4m3 blocks (a quarter
of float32's bytes, half of bf16's), a step's attention reads K/V back from them (the logits
move by FP8's rounding, not more), blocks offloaded to the host tier come back as the same FP8
bytes (a host hit gives the tokens of computing the prompt afresh), and an unknown dtype is
refused by name."""
from __future__ import annotations

import dataclasses
import pathlib
import random

import pytest
import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.build import kv_cache_dtype
from tandem.engines.reference.engine import ReferenceEngine
from tandem.errors import InvalidRequest
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_host_tier import (
    BS,
    check_all_free,
    drain,
    engine_for,
    step_until_idle,
    tokens,
)

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp8-kv") / "llama", "llama", seed=4)


async def prompt_logits(engine: ReferenceEngine, prompt: list[int]) -> torch.Tensor:
    """The logits of every position of `prompt`, run as one prefill step through `engine`'s
    model and KV pool (blocks 0.. of the pool)."""
    from tests.unit.test_reference_model import make_step

    blocks = list(range(-(-len(prompt) // BS)))
    ids, positions, meta = make_step([(prompt, blocks, 0)], block_size=BS)
    with torch.no_grad():
        return engine.model.compute_logits(engine.model(ids, positions, meta, engine.kv_cache))


async def test_the_pool_holds_fp8_blocks_and_attention_reads_them(model_dir: pathlib.Path
                                                                  ) -> None:
    fp8 = engine_for(model_dir, 16, kv_cache_dtype="fp8")
    full = engine_for(model_dir, 16)
    assert fp8.kv_cache.dtype == FP8 and full.kv_cache.dtype == torch.float32
    assert fp8.layout.dtype == "float8_e4m3fn"
    assert fp8.kv_cache.nbytes * 4 == full.kv_cache.nbytes
    prompt = tokens(random.Random(3), fp8.vocab_size, 3 * BS)
    ours, theirs = await prompt_logits(fp8, prompt), await prompt_logits(full, prompt)
    # K/V rounded to e4m3 (3 mantissa bits: at most 2^-4 relative each) move the logits.
    error = float((ours - theirs).norm() / theirs.norm())
    assert 0 < error < 0.1, error
    await fp8.close()
    await full.close()


async def test_host_tier_hits_give_the_tokens_of_a_fresh_prefill(model_dir: pathlib.Path
                                                                ) -> None:
    """The first prompt's FP8 blocks go to the host tier and come back for its next turn: the
    tokens equal those of an engine that computes the whole turn afresh (FP8 KV too)."""
    engine = engine_for(model_dir, 10, max_num_tokens=12, kv_cache_dtype="fp8")
    rng = random.Random(11)
    first = tokens(rng, engine.vocab_size, 5 * BS)
    for i, prompt in enumerate([first, *(tokens(rng, engine.vocab_size, 5 * BS)
                                         for _ in range(2))]):
        await drain((await step_until_idle(engine, {0: [(f"warm{i}", prompt)]}))[f"warm{i}"])
    follow = first + tokens(rng, engine.vocab_size, 20)
    onboarded = engine.host_copies.num_onboard_blocks
    out, usage = await drain((await step_until_idle(engine, {0: [("turn2", follow)]}))["turn2"])
    assert engine.host_copies.num_onboard_blocks - onboarded == len(first) // BS
    assert usage.cached_tokens == len(first)
    check_all_free(engine)
    await engine.close()

    fresh = engine_for(model_dir, 64, max_num_tokens=12, kv_cache_dtype="fp8")
    again, usage = await drain((await step_until_idle(fresh, {0: [("fresh", follow)]}))["fresh"])
    assert usage.cached_tokens == 0
    assert out == again
    await fresh.close()


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    args = dataclasses.replace(EngineArgs(), kv_cache_dtype="int8")
    with pytest.raises(InvalidRequest, match="kv_cache_dtype must be one of auto, fp8"):
        kv_cache_dtype(args, torch.bfloat16)
