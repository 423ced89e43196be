"""Speculative decoding in the reference engine: the same tokens (and logprobs) as without it,
greedy and seeded, with penalties, stops, preemption and prefix hits; proposals really accepted;
after every step no proposal is left in a request, no block is held past a request's tokens and
every committed block hash is one of accepted tokens only."""
from __future__ import annotations

import asyncio
import json
import pathlib
import random
from collections.abc import Callable
from typing import Any

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams, TokenChunk
from tandem.errors import InvalidRequest
from tandem.kv.hashing import hash_block
from tandem.model.tiny import write_tiny_model

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, ' \
        '"prompt_lookup_max": 3, "disable_by_batch_size": 0}'
BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


def engine_for(model: pathlib.Path, spec: str = "", **overrides: object) -> ReferenceEngine:
    args = EngineArgs(model=str(model), device="cpu", kv_block_size=BS,
                      num_gpu_blocks=overrides.pop("num_gpu_blocks", 512),
                      speculative_config=spec, **overrides)  # type: ignore[arg-type]
    return create_reference_engine(args)  # type: ignore[return-value]


def copy_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so that prompt lookup has something to propose."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(5, vocab) for _ in range(rng.randrange(3, 9))]
        out.append(phrase * rng.randrange(2, 5) + phrase[: rng.randrange(1, len(phrase))])
    return out


def check_after_each_step(engine: ReferenceEngine) -> list[int]:
    """Wraps the engine's step with the rollback invariants; returns the list the number of
    checked steps is appended to."""
    step = engine._step
    checked: list[int] = []

    async def checked_step() -> object:
        plan = await step()
        pool = engine.pool
        live = [r for r in engine._requests.values() if not r.is_finished]
        pool.check_invariants([r.table for r in live])
        for req in live:
            assert req.num_draft == 0, "a proposal outlived its verify pass"
            assert len(req.table) <= pool.blocks_for(len(req.token_ids)), \
                "blocks held past the request's tokens"
            prev = None
            for i in range(req.table.num_committed):
                prev = hash_block(prev, req.token_ids[i * BS:(i + 1) * BS],
                                  req.mm_per_block[i] if req.mm_per_block else ())
                assert req.hashes[i] == prev, f"block {i} committed with another hash"
        checked.append(1)
        return plan

    engine._step = checked_step  # type: ignore[method-assign]
    return checked


async def generate(engine: ReferenceEngine, batch: list[list[int]],
                   sampling: SamplingParams | Callable[[int], SamplingParams]
                   ) -> list[list[TokenChunk]]:
    await engine.start()
    try:
        streams = [engine.add_request(EngineRequest(
            f"r{i}", tuple(p), sampling(i) if callable(sampling) else sampling))
            for i, p in enumerate(batch)]

        async def collect(stream: object) -> list[TokenChunk]:
            return [chunk async for chunk in stream]  # type: ignore[attr-defined]

        return await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.close()


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def logprobs(chunks: list[TokenChunk]) -> list[float]:
    return [lp.logprob for c in chunks for lp in (c.logprobs or ())]


def draft_config(draft: pathlib.Path, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "num_speculative_tokens": k,
                       "model": str(draft), "disable_by_batch_size": 0})


def compare(model: pathlib.Path, batch: list[list[int]],
            sampling: SamplingParams | Callable[[int], SamplingParams], spec: str = NGRAM,
            **overrides: object
            ) -> tuple[list[list[TokenChunk]], list[list[TokenChunk]], ReferenceEngine]:
    plain = asyncio.run(generate(engine_for(model, **dict(overrides)), batch, sampling))
    spec_engine = engine_for(model, spec, **overrides)
    checked = check_after_each_step(spec_engine)
    spec = asyncio.run(generate(spec_engine, batch, sampling))
    assert checked, "no step was checked"
    assert [tokens(c) for c in spec] == [tokens(c) for c in plain]
    assert [c[-1].finish_reason for c in spec] == [c[-1].finish_reason for c in plain]
    return plain, spec, spec_engine


def test_greedy_equal_and_proposals_accepted(tiny: pathlib.Path) -> None:
    batch = copy_prompts(256, 6)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, top_logprobs=2)
    plain, spec, engine = compare(tiny, batch, greedy)
    for p, s in zip(plain, spec, strict=True):
        assert logprobs(s) == pytest.approx(logprobs(p), abs=1e-4)
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_by_position[0] >= stats.spec_accepted_by_position[-1]
    usage = [c[-1].usage for c in spec]
    assert sum(u.accepted_prediction_tokens for u in usage) == stats.spec_accepted_tokens
    assert sum(u.accepted_prediction_tokens + u.rejected_prediction_tokens
               for u in usage) == stats.spec_proposed_tokens
    # Fewer steps than tokens: verify passes emitted several tokens each.
    assert engine.num_steps < sum(len(tokens(c)) for c in spec)


def test_seeded_sampling_with_penalties_equal(tiny: pathlib.Path) -> None:
    batch = copy_prompts(256, 5, seed=1)

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=30, temperature=0.7, top_k=8 if i % 2 else 0,
                              top_p=0.9, seed=100 + i, repetition_penalty=1.0 + 0.1 * (i % 3),
                              ignore_eos=True)

    compare(tiny, batch, sampling)


def test_stops_min_tokens_and_short_outputs_equal(tiny: pathlib.Path) -> None:
    batch = copy_prompts(256, 8, seed=2)

    def sampling(i: int) -> SamplingParams:
        # Stop ids drawn from the prompt (so proposals carry them), some short max_tokens.
        return SamplingParams(max_tokens=1 + 3 * i, temperature=0.0,
                              stop_token_ids=(batch[i][1], batch[i][2]), min_tokens=i % 3)

    compare(tiny, batch, sampling)


def test_preemption_and_prefix_hits_equal(tiny: pathlib.Path) -> None:
    shared = copy_prompts(256, 1, seed=3)[0]
    batch = [shared + p for p in copy_prompts(256, 10, seed=4)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, _, engine = compare(tiny, batch, greedy, num_gpu_blocks=40)
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.prefix_hit_rate > 0


def test_opt_out_and_batch_size_policy(tiny: pathlib.Path) -> None:
    batch = copy_prompts(256, 4, seed=5)
    off = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=False)
    _, _, engine = compare(tiny, batch, off)
    assert engine.stats().spec_proposed_tokens == 0
    # Four requests running, a limit of 2: no step speculates until two have finished.
    limited = NGRAM.replace('"disable_by_batch_size": 0', '"disable_by_batch_size": 2')
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine = engine_for(tiny, limited)
    asyncio.run(generate(engine, batch, greedy))
    assert engine.stats().spec_proposed_tokens == 0
    engine = engine_for(tiny, limited)
    asyncio.run(generate(engine, batch[:2], greedy))
    assert engine.stats().spec_proposed_tokens > 0


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle3", "num_speculative_tokens": 3, "model": "x"}', "EAGLE-3 head"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}',
     "disable_by_batch_size"),
    ("[1]", "JSON object"),
])
def test_bad_configs_refused(tiny: pathlib.Path, config: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        engine_for(tiny, config)
    assert info.value.param == "speculative_config"


def test_mock_engine_refuses_speculation(tiny: pathlib.Path) -> None:
    from tandem.engines.mock.engine import create_mock_engine
    with pytest.raises(InvalidRequest, match="does not speculate"):
        create_mock_engine(EngineArgs(model=str(tiny), speculative_config=NGRAM))


def test_draft_model_equal_and_its_own_draft_accepts_all(tiny: pathlib.Path,
                                                         tmp_path: pathlib.Path) -> None:
    batch = copy_prompts(256, 5, seed=6)
    greedy = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)
    # The target as its own draft: every greedy guess is the target's own token.
    _, spec, engine = compare(tiny, batch, greedy, draft_config(tiny))
    stats = engine.stats()
    assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens > 0
    # Another model of the same vocabulary: guesses mostly wrong, output the same; with
    # preemption (the draft's KV is rebuilt when its blocks are replaced) and sampling.
    other = write_tiny_model(tmp_path / "draft", "llama", seed=9)
    compare(tiny, batch, greedy, draft_config(other, k=4), num_gpu_blocks=40)
    seeded = SamplingParams(max_tokens=25, temperature=0.9, seed=7, ignore_eos=True)
    compare(tiny, batch, seeded, draft_config(tiny))


def test_draft_model_of_another_vocabulary_refused(tiny: pathlib.Path,
                                                    tmp_path: pathlib.Path) -> None:
    other = write_tiny_model(tmp_path / "qwen", "qwen3", seed=1)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="vocabulary|cannot be loaded"):
        engine_for(tiny, draft_config(other))


def test_rounds_without_proposals_back_off_to_overlap_scheduling(tiny: pathlib.Path) -> None:
    """Prompts without repeats: prompt lookup finds little, so most steps skip speculation and
    are launched ahead of the previous step's tokens; the output stays the same."""
    rng = random.Random(8)
    batch = [rng.sample(range(5, 256), 40) for _ in range(3)]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    strict = NGRAM.replace('"prompt_lookup_min": 1', '"prompt_lookup_min": 3')
    _, _, engine = compare(tiny, batch, greedy, strict)
    assert engine.num_steps_ahead > 0
    plain = engine_for(tiny)
    asyncio.run(generate(plain, batch, greedy))
    # Some rounds still propose (the backoff is at most MAX_BACKOFF_STEPS long).
    assert 0 < engine.num_steps_ahead < plain.num_steps_ahead


def guided_tokenizer(model: pathlib.Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def guided_case(model: pathlib.Path
                ) -> tuple[list[list[int]], Callable[[int], SamplingParams]]:
    """Four requests for a small JSON schema (greedy and sampled), whose prompt shows two
    examples of it."""
    from tandem.engines.types import GuidedDecoding, GuidedKind

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "city": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
        "required": ["name", "city", "tags"]}
    example = '{"name": "ab", "city": "cd", "tags": ["red", "green", "blue"]}'
    prompt = guided_tokenizer(model).encode(example + " " + example, add_special_tokens=False)
    guided = GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(schema))

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 0.8, seed=i,
                              guided=guided)

    return [prompt] * 4, sampling


def test_guided_requests_speculate_under_their_grammar(tiny: pathlib.Path) -> None:
    """The grammar checks proposals (cut at the first it forbids) and masks each row of the
    verify pass as it stood at that position: the same JSON as without speculation, with
    proposals accepted (the forced keys and punctuation prompt lookup finds in the prompt)."""
    _, spec, engine = compare(tiny, *guided_case(tiny))
    for chunks in spec:
        json.loads(guided_tokenizer(tiny).decode(tokens(chunks), skip_special_tokens=True))
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0


def test_masks_along_proposals_cut_at_the_first_forbidden_and_leave_the_guide(
        tiny: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    from tandem.engines.guided.matcher import Grammars, bitmask_words
    from tandem.engines.types import GuidedDecoding, GuidedKind

    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    vocab = len(tokenizer)
    grammars = Grammars.from_model_dir(tiny, vocab, frozenset())
    guide = grammars.guide(GuidedDecoding(GuidedKind.REGEX, r"ab(c|d)+"), ())
    a, b, c, x = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c", "x"))
    width = bitmask_words(vocab)
    kept, masks = guide.masks_along([a, b, c, x, c], width)
    assert kept == [a, b, c] and masks.shape == (4, width)

    def allowed(row: int) -> bool:
        return bool((masks[row, row_token[row] // 32] >> (row_token[row] % 32)) & 1)

    row_token = [a, b, c, c]
    assert all(allowed(r) for r in range(4))
    row_token = [b, a, a, x]
    assert not any(allowed(r) for r in range(4))
    # The guide is where it was: "a" is still the only start.
    assert guide.accept(a) and not guide.accept(a)


def test_a_request_finished_by_the_step_settled_for_a_proposal_round(tiny: pathlib.Path) -> None:
    """While backing off, steps run ahead; the round after settles the last one, whose token
    may finish the only request: the loop then waits for work instead of failing. One request
    at a time, at every length up to 24 tokens, meets that at some length."""
    prompt = random.Random(9).sample(range(5, 256), 30)
    strict = NGRAM.replace('"prompt_lookup_min": 1', '"prompt_lookup_min": 3')

    async def each_length(engine: ReferenceEngine) -> list[list[int]]:
        await engine.start()
        outs = []
        try:
            for n in range(1, 25):
                stream = engine.add_request(EngineRequest(f"n{n}", tuple(prompt), SamplingParams(
                    max_tokens=n, temperature=0.0, ignore_eos=True)))
                outs.append([t async for c in stream for t in c.token_ids])
        finally:
            await engine.close()
        return outs

    plain = asyncio.run(each_length(engine_for(tiny)))
    assert asyncio.run(each_length(engine_for(tiny, strict))) == plain


def test_the_demo_draft_is_really_accepted() -> None:
    """The demo model with its distilled draft (tandem.model.train_draft), and with prompt
    lookup: the same tokens as plain decoding on held-out corpus prompts, and most proposals accepted (measured: 3.8
    tokens per verify pass at k = 4, benchmarks/spec_cpu.py; a third of that would show a
    draft that guesses nothing)."""
    from tokenizers import Tokenizer

    from tandem.model import demo, draft_eval

    model = demo.ensure_demo_model()
    prompts = draft_eval.eval_prompts(Tokenizer.from_file(str(model / "tokenizer.json")))[
        "held-out corpus"][:6]
    config = draft_config(demo.draft_model_dir(model), k=4)
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    args = {"model": str(model), "device": "cpu"}
    plain = asyncio.run(generate(create_reference_engine(EngineArgs(**args)), prompts, greedy))
    engine = create_reference_engine(EngineArgs(**args, speculative_config=config))
    spec = asyncio.run(generate(engine, prompts, greedy))  # type: ignore[arg-type]
    assert [tokens(c) for c in spec] == [tokens(c) for c in plain]
    assert engine.speculation is not None
    assert engine.speculation.counters.mean_accepted_length > 2.5
    # Prompt lookup on the demo: the same tokens too.
    lookup = create_reference_engine(EngineArgs(**args, speculative_config=NGRAM))
    assert [tokens(c) for c in asyncio.run(generate(lookup, prompts, greedy))] == \
        [tokens(c) for c in plain]  # type: ignore[arg-type]
