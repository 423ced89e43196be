"""The reference engine against Hugging Face transformers: greedy tokens equal `generate` token
for token for every supported family, also with chunked prefill, prefix-cache hits and
preemption; seeded sampling does not depend on the batch; every block goes back to the pool."""
from __future__ import annotations

import asyncio
import pathlib
import random

import pytest
import torch
import transformers

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.types import EngineRequest, FinishReason, SamplingParams
from tandem.model.tiny import write_tiny_model

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gpt_oss"]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_model(root / f, f, seed=3) for f in FAMILIES}


def prompts(vocab: int, lengths: list[int], seed: int = 0, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


_HF_CACHE: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def hf_greedy(model_dir: pathlib.Path, prompt: list[int]) -> list[int]:
    key = (str(model_dir), tuple(prompt))
    if key not in _HF_CACHE:
        model = _hf_model(str(model_dir))
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        _HF_CACHE[key] = out[0, len(prompt):].tolist()
    return _HF_CACHE[key]


_MODELS: dict[str, transformers.PreTrainedModel] = {}


def _hf_model(path: str) -> transformers.PreTrainedModel:
    if path not in _MODELS:
        _MODELS[path] = transformers.AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32).eval()
    return _MODELS[path]


def engine_for(model_dir: pathlib.Path, **overrides: object) -> ReferenceEngine:
    args = EngineArgs(model=str(model_dir), device="cpu", kv_block_size=8,
                      num_gpu_blocks=overrides.pop("num_gpu_blocks", 256), **overrides)
    return create_reference_engine(args)


async def run(engine: ReferenceEngine, batch: list[list[int]],
              sampling: SamplingParams | None = None) -> list[tuple[list[int], object]]:
    """Submits every prompt at once; returns (tokens, usage) per prompt."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, min_tokens=NEW_TOKENS)
    streams = [engine.add_request(EngineRequest(f"r{i}-{random.random()}", tuple(p),
                                                sampling or greedy))
               for i, p in enumerate(batch)]

    async def collect(stream) -> tuple[list[int], object]:
        tokens: list[int] = []
        usage = None
        async for chunk in stream:
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                assert chunk.finish_reason == FinishReason.LENGTH
                usage = chunk.usage
        return tokens, usage

    return await asyncio.gather(*(collect(s) for s in streams))


@pytest.mark.parametrize("family", FAMILIES)
async def test_greedy_matches_transformers_on_a_mixed_batch(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    engine = engine_for(model_dirs[family])
    await engine.start()
    try:
        batch = prompts(engine.vocab_size, [3, 17, 40, 9])
        results = await run(engine, batch)
        for prompt, (tokens, usage) in zip(batch, results):
            assert tokens == hf_greedy(model_dirs[family], prompt)
            assert usage.completion_tokens == NEW_TOKENS
        assert engine.pool.num_used == 0  # every block's ref count is back to zero
    finally:
        await engine.close()


@pytest.mark.parametrize("family", FAMILIES)
async def test_chunked_prefill_gives_the_same_tokens(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    engine = engine_for(model_dirs[family], max_num_tokens=12)  # every prompt is chunked
    await engine.start()
    try:
        batch = prompts(engine.vocab_size, [30, 45, 7], seed=1)
        results = await run(engine, batch)
        for prompt, (tokens, _) in zip(batch, results):
            assert tokens == hf_greedy(model_dirs[family], prompt)
    finally:
        await engine.close()


@pytest.mark.parametrize("family", FAMILIES)
async def test_prefix_cache_hits_give_the_same_tokens(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    engine = engine_for(model_dirs[family])
    await engine.start()
    try:
        shared = prompts(engine.vocab_size, [40], seed=2)[0]
        first = prompts(engine.vocab_size, [5], seed=3, prefix=shared)
        (tokens, usage), = await run(engine, first)
        assert usage.cached_tokens == 0
        assert tokens == hf_greedy(model_dirs[family], first[0])
        later = prompts(engine.vocab_size, [6, 11], seed=4, prefix=shared)
        results = await run(engine, later)
        for prompt, (tokens, usage) in zip(later, results):
            assert usage.cached_tokens == 40  # five full blocks of 8 shared
            assert tokens == hf_greedy(model_dirs[family], prompt)
        assert engine.pool.num_used == 0
    finally:
        await engine.close()


@pytest.mark.parametrize("family", FAMILIES)
async def test_preemption_by_recompute_gives_the_same_tokens(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    # Three prompts of 4 blocks each fill the 12-block pool at admission; each needs a fifth
    # block two tokens later, so the newest must be preempted and recomputed.
    engine = engine_for(model_dirs[family], num_gpu_blocks=12)
    await engine.start()
    try:
        batch = prompts(engine.vocab_size, [30, 31, 29], seed=5)
        results = await run(engine, batch)
        assert engine.scheduler.num_preemptions > 0
        for prompt, (tokens, _) in zip(batch, results):
            assert tokens == hf_greedy(model_dirs[family], prompt)
        assert engine.pool.num_used == 0
    finally:
        await engine.close()


async def test_seeded_sampling_does_not_depend_on_the_batch(
        model_dirs: dict[str, pathlib.Path]) -> None:
    engine = engine_for(model_dirs["llama"])
    await engine.start()
    try:
        sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
        prompt = prompts(engine.vocab_size, [15], seed=6)
        (alone, _), = await run(engine, prompt, sampled)
        (again, _), = await run(engine, prompt, sampled)
        crowd = prompts(engine.vocab_size, [4, 22, 9], seed=8)
        results = await run(engine, crowd + prompt, sampled)
        assert alone == again == results[-1][0]
        other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=8)
        (different, _), = await run(engine, prompt, other_seed)
        assert different != alone
    finally:
        await engine.close()


async def test_abort_frees_blocks_at_once(model_dirs: dict[str, pathlib.Path]) -> None:
    engine = engine_for(model_dirs["llama"])
    await engine.start()
    try:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = engine.add_request(EngineRequest("long", tuple(range(10, 50)), long))
        first = await anext(stream)
        assert first.token_ids and engine.pool.num_used > 0
        assert engine.abort("long")
        assert engine.pool.num_used == 0
        rest = [chunk async for chunk in stream]
        assert rest[-1].finish_reason == FinishReason.CANCELLED
    finally:
        await engine.close()


LOGPROB_ATOL = 1e-4  # float32 on CPU; the model's logits match transformers to ~1e-6


async def test_logprobs_agree_with_transformers(model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs["qwen3"]
    # A small token budget chunks the prompt, so prompt logprobs cross chunk boundaries.
    engine = engine_for(model_dir, max_num_tokens=7)
    await engine.start()
    try:
        prompt = prompts(engine.vocab_size, [19], seed=9)[0]
        params = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6, top_logprobs=3,
                                prompt_logprobs=2)
        stream = engine.add_request(EngineRequest("lp", tuple(prompt), params))
        chunks = [chunk async for chunk in stream]
    finally:
        await engine.close()
    tokens = [t for c in chunks for t in c.token_ids]
    token_lps = [lp for c in chunks for lp in c.logprobs]
    prompt_lps = chunks[0].prompt_logprobs
    assert tokens == hf_greedy(model_dir, prompt)[:6]

    hf = _hf_model(str(model_dir))
    with torch.no_grad():
        full = torch.tensor([prompt + tokens[:-1]])
        ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
    # Prompt logprobs: position p predicts prompt[p + 1].
    assert len(prompt_lps) == len(prompt) - 1
    for p, lp in enumerate(prompt_lps):
        assert lp.token_id == prompt[p + 1]
        assert abs(lp.logprob - ref[p, prompt[p + 1]].item()) < LOGPROB_ATOL
        best = torch.topk(ref[p], 2)
        assert [a.token_id for a in lp.top] == best.indices.tolist()
    # Output logprobs: token i is predicted at position len(prompt) - 1 + i.
    assert len(token_lps) == 6
    for i, lp in enumerate(token_lps):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == tokens[i]
        assert abs(lp.logprob - row[tokens[i]].item()) < LOGPROB_ATOL
        best = torch.topk(row, 3)
        assert [a.token_id for a in lp.top] == best.indices.tolist()
        for alt, value in zip(lp.top, best.values.tolist()):
            assert abs(alt.logprob - value) < LOGPROB_ATOL


def test_max_seq_len_beyond_the_model_is_refused(model_dirs: dict[str, pathlib.Path]) -> None:
    from tandem.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="max_position_embeddings"):
        engine_for(model_dirs["llama"], max_seq_len=10**6)


async def test_repetition_penalty_matches_transformers(model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs["llama"]
    engine = engine_for(model_dir)
    await engine.start()
    try:
        prompt = prompts(engine.vocab_size, [12], seed=11)[0]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, min_tokens=NEW_TOKENS,
                                repetition_penalty=1.5)
        (tokens, _), = await run(engine, [prompt], params)
    finally:
        await engine.close()
    hf = _hf_model(str(model_dir))
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                      min_new_tokens=NEW_TOKENS, repetition_penalty=1.5,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert tokens == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES[:1])
async def test_warm_eager_steps_touch_only_the_scratch_block(
        family: str, model_dirs: dict[str, pathlib.Path]) -> None:
    """The warm-up before serving (run on CUDA at start; here called on the CPU) runs its four
    step shapes through the engine's own step code, leaves the pool as it was and every
    pooled block's KV untouched, and the engine still matches transformers afterwards."""
    from tandem.engines.reference.warmup import warm_eager_steps

    engine = engine_for(model_dirs[family], max_num_tokens=48, max_batch_size=6)
    await engine.start()
    try:
        pooled = engine.kv_cache[:, :, :-1].clone()
        free = engine.pool.num_free
        assert warm_eager_steps(engine) == 4
        assert engine.pool.num_free == free and engine.pool.num_used == 0
        assert torch.equal(engine.kv_cache[:, :, :-1], pooled)
        batch = prompts(engine.vocab_size, [3, 17])
        for prompt, (tokens, _) in zip(batch, await run(engine, batch)):
            assert tokens == hf_greedy(model_dirs[family], prompt)
    finally:
        await engine.close()
