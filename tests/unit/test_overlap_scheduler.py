"""Overlap scheduling in the reference engine (tandem.engines.batching.ahead): decode steps
launched ahead of the previous step's tokens give exactly what steps computed in full give (the
same tokens, logprobs, finish reasons and cached blocks), whatever finishes, stops or is aborted
while a step runs ahead, guided or not; requests that need their history on the host never
run ahead."""
from __future__ import annotations

import asyncio
import json
import pathlib
import random

import jsonschema
import pytest
from transformers import AutoTokenizer

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.types import EngineRequest, GuidedDecoding, GuidedKind, SamplingParams
from tandem.kv.hashing import hash_block
from tandem.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


def engine_for(model_dir: pathlib.Path, overlap: bool, **overrides: object) -> ReferenceEngine:
    args = EngineArgs(model=str(model_dir), device="cpu", kv_block_size=4, num_gpu_blocks=128,
                      disable_overlap_scheduler=not overlap, **overrides)
    engine = create_reference_engine(args)
    assert isinstance(engine, ReferenceEngine)
    return engine


def prompt(vocab: int, n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(5, vocab) for _ in range(n))


Outcome = tuple[list[int], list[tuple[int, float] | None], str | None, int]


async def collect(engine: ReferenceEngine, request: EngineRequest, delay: float = 0.0,
                  abort_after: int | None = None) -> Outcome:
    """(tokens, (token, logprob) per token where asked, finish reason, completion tokens)."""
    await asyncio.sleep(delay)
    stream = engine.add_request(request)
    tokens: list[int] = []
    logprobs: list[tuple[int, float] | None] = []
    reason, completion = None, -1
    async for chunk in stream:
        tokens.extend(chunk.token_ids)
        logprobs.extend((lp.token_id, round(lp.logprob, 4)) if lp else None
                        for lp in chunk.logprobs or [None] * len(chunk.token_ids))
        if abort_after is not None and len(tokens) >= abort_after:
            engine.abort(request.request_id)
            abort_after = None
        if chunk.finish_reason is not None:
            reason = chunk.finish_reason.value
            completion = chunk.usage.completion_tokens if chunk.usage else -1
    return tokens, logprobs, reason, completion


def requests(vocab: int, stop_id: int) -> list[tuple[EngineRequest, float, int | None]]:
    """A mix that finishes at different steps: greedy, seeded draws, logprobs, a stop token
    met mid-stream, min_tokens, one aborted, one arriving while the others decode."""
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    return [
        (EngineRequest("greedy", prompt(vocab, 6, 1), greedy), 0.0, None),
        (EngineRequest("short", prompt(vocab, 3, 2),
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)), 0.0, None),
        (EngineRequest("drawn", prompt(vocab, 9, 3),
                       SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=11,
                                      ignore_eos=True, top_logprobs=2)), 0.0, None),
        (EngineRequest("stopped", prompt(vocab, 5, 4),
                       SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_id,),
                                      min_tokens=2)), 0.0, None),
        (EngineRequest("aborted", prompt(vocab, 7, 5),
                       SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)), 0.0, 4),
        (EngineRequest("late", prompt(vocab, 4, 6),
                       SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True,
                                      top_logprobs=0)), 0.05, None),
    ]


async def serve(engine: ReferenceEngine, stop_id: int) -> dict[str, Outcome]:
    await engine.start()
    try:
        batch = requests(engine.vocab_size, stop_id)
        outcomes = await asyncio.gather(*(collect(engine, r, delay, abort_after)
                                          for r, delay, abort_after in batch))
        assert engine.pool.num_used == 0
        engine.pool.check_invariants()
        return {r.request_id: o for (r, _, _), o in zip(batch, outcomes)}
    finally:
        await engine.close()


async def test_steps_ahead_give_what_full_steps_give(model_dir: pathlib.Path) -> None:
    probe = engine_for(model_dir, overlap=False)
    await probe.start()
    try:  # a token that "stopped" meets at its fourth output: it stops there
        request = EngineRequest("probe", prompt(probe.vocab_size, 5, 4),
                                SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        stop_id = (await collect(probe, request))[0][3]
    finally:
        await probe.close()

    full = engine_for(model_dir, overlap=False)
    expected = await serve(full, stop_id)
    ahead = engine_for(model_dir, overlap=True)
    got = await serve(ahead, stop_id)
    # Where the abort lands depends on timing; what it streamed before is the same.
    aborted, aborted_full = got.pop("aborted"), expected.pop("aborted")
    assert aborted[0][:4] == aborted_full[0][:4] and aborted[2] == aborted_full[2] == "cancelled"
    assert got == expected
    assert full.num_steps_ahead == 0
    assert ahead.num_steps_ahead > 5
    assert len(got["stopped"][0]) <= 4 and got["stopped"][2] == "stop"
    assert got["drawn"][1][0] is not None and got["greedy"][1][0] is None
    # Every block the prefix cache kept holds real tokens: no placeholder was hashed.
    sequences = [r.prompt_token_ids + tuple(got.get(r.request_id, aborted)[0])
                 for r, _, _ in requests(ahead.vocab_size, stop_id)]
    assert ahead.pool.hashes() <= block_hashes(sequences, 4)
    assert full.pool.hashes() <= block_hashes(sequences, 4)


def block_hashes(sequences: list[tuple[int, ...]], block_size: int) -> set[int]:
    """The chained hashes of every full block of each sequence."""
    out: set[int] = set()
    for tokens in sequences:
        parent = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_block(parent, list(tokens[start:start + block_size]), ())
            out.add(parent)
    return out


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
    "required": ["name", "tags"]}


async def test_guided_requests_run_ahead_and_keep_their_grammar(
        model_dir: pathlib.Path) -> None:
    """The step ahead takes the previous step's tokens into the grammars itself: every output
    is the same as with full steps, and valid."""
    guided = GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    outcomes = {}
    for overlap in (False, True):
        engine = engine_for(model_dir, overlap)
        await engine.start()
        try:
            batch = [EngineRequest(f"g{i}", prompt(engine.vocab_size, 4 + i, i), SamplingParams(
                max_tokens=120, temperature=0.8, seed=i, guided=guided if i % 3 else None))
                for i in range(6)]
            outcomes[overlap] = await asyncio.gather(*(collect(engine, r) for r in batch))
            assert (engine.num_steps_ahead > 10) == overlap
            assert engine.pool.num_used == 0
        finally:
            await engine.close()
    assert outcomes[True] == outcomes[False]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for i, (tokens, _, reason, _) in enumerate(outcomes[True]):
        if i % 3:
            assert reason == "stop"
            jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)),
                                SCHEMA)


async def test_penalized_and_prefill_only_requests_never_run_ahead(
        model_dir: pathlib.Path) -> None:
    engine = engine_for(model_dir, overlap=True)
    await engine.start()
    try:
        penalized = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                   repetition_penalty=1.3)
        outcomes = await asyncio.gather(*(
            collect(engine, EngineRequest(f"p{i}", prompt(engine.vocab_size, 5, i), penalized))
            for i in range(3)))
        assert all(len(tokens) == 8 for tokens, *_ in outcomes)
        assert engine.num_steps_ahead == 0
    finally:
        await engine.close()


async def test_close_while_a_step_runs_ahead_settles_it(model_dir: pathlib.Path) -> None:
    engine = engine_for(model_dir, overlap=True)
    await engine.start()
    stream = engine.add_request(EngineRequest(
        "long", prompt(engine.vocab_size, 6, 9),
        SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)))
    async for _ in stream:
        if engine.num_steps_ahead > 3:
            break
    await engine.close()
    assert engine.overlap is not None and engine.overlap.executor._shutdown
    assert engine.pool.num_used == 0
