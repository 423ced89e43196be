"""Guided decoding inside the batching engines, on a tiny random-weights Llama with the demo
tokenizer: every output satisfies its constraint; the grammar follows emitted tokens only, so
preemption (recompute), a migrated request's already-generated tokens and a disaggregated
handoff's first token each move it exactly once."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pathlib
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from tandem.engines.args import EngineArgs
from tandem.engines.batching.engine import BatchingEngine
from tandem.engines.guided.grammar import to_grammar
from tandem.engines.guided.matcher import Grammars, allowed_ids, fill_bitmask
from tandem.engines.mock.engine import create_mock_engine
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import (
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    SamplingParams,
)
from tandem.errors import FailedPrecondition, InvalidRequest
from tandem.model.tiny import write_tiny_model

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
     "required": ["name", "age", "address"]},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "minItems": 1, "maxItems": 3}}, "required": ["color", "tags"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"},
                                                      {"type": "null"}]}}, "required": ["v"]},
]
MAX_TOKENS = 300


def schema(s: dict[str, object]) -> GuidedDecoding:
    return GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(s))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: pathlib.Path) -> object:
    return AutoTokenizer.from_pretrained(str(model_dir))


def reference(model_dir: pathlib.Path, **overrides: object) -> BatchingEngine:
    args = EngineArgs(model=str(model_dir), device="cpu", kv_block_size=8,
                      **{"num_gpu_blocks": 512, **overrides})  # type: ignore[arg-type]
    engine = create_reference_engine(args)
    assert isinstance(engine, BatchingEngine)
    return engine


def mock(model_dir: pathlib.Path, **overrides: object) -> BatchingEngine:
    return create_mock_engine(EngineArgs(model=str(model_dir), speedup_ratio=0, kv_block_size=8,
                                         **overrides))  # type: ignore[arg-type]


async def generate(engine: BatchingEngine, requests: list[EngineRequest]
                   ) -> list[tuple[list[int], FinishReason | None]]:
    async def one(request: EngineRequest) -> tuple[list[int], FinishReason | None]:
        tokens, finish = [], None
        async for chunk in engine.add_request(request):
            tokens += chunk.token_ids
            finish = chunk.finish_reason
        return tokens, finish
    return list(await asyncio.gather(*(one(r) for r in requests)))


def text(tokenizer: object, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)  # type: ignore[attr-defined]


def request(rid: str, prompt: list[int], guided: GuidedDecoding, seed: int,
            max_tokens: int = MAX_TOKENS, temperature: float = 1.0) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, guided=guided))


@pytest.mark.parametrize("make", [reference, mock])
async def test_outputs_satisfy_their_constraints(make, model_dir: pathlib.Path,  # noqa: ANN001
                                                 tokenizer: object) -> None:
    engine = make(model_dir)
    await engine.start()
    try:
        prompt = [5, 60, 70, 80]
        cases = [(s, schema(s)) for s in SCHEMAS]
        regex = GuidedDecoding(GuidedKind.REGEX, r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)")
        choice = GuidedDecoding(GuidedKind.CHOICE, choices=("yes", "no", "it \"depends\""))
        requests = [request(f"s{i}-{seed}", prompt, g, seed) for i, (_, g) in enumerate(cases)
                    for seed in range(3)]
        requests += [request(f"r{seed}", prompt, regex, seed) for seed in range(3)]
        requests += [request(f"c{seed}", prompt, choice, seed) for seed in range(3)]
        results = await generate(engine, requests)
        for req, (tokens, finish) in zip(requests, results):
            assert finish == FinishReason.STOP, (req.request_id, text(tokenizer, tokens))
            out = text(tokenizer, tokens)
            guided = req.sampling.guided
            assert guided is not None
            if guided.kind is GuidedKind.JSON_SCHEMA:
                jsonschema.validate(json.loads(out), json.loads(guided.spec))
            elif guided.kind is GuidedKind.REGEX:
                assert re.fullmatch(guided.spec, out), out
            else:
                assert out in guided.choices
        assert engine.pool.num_used == 0
    finally:
        await engine.close()


async def test_json_strings_never_hold_raw_control_characters(model_dir: pathlib.Path) -> None:
    # xgrammar writes length-bounded strings with a character class that lets a tab or U+0017
    # in; tandem.engines.guided.grammar rewrites it.
    grammars = Grammars.from_model_dir(model_dir, 4096, [1, 3])
    tab = next(i for i, t in enumerate(grammars.decoded_vocab) if t == b"\t")
    quote = next(i for i, t in enumerate(grammars.decoded_vocab) if t == b'"')
    guide = grammars.guide(schema({"type": "string", "maxLength": 5}), [])
    assert guide.accept(quote)
    bitmask = fill_bitmask([guide], 4096)
    assert bitmask is not None and not (int(bitmask[0, tab // 32]) >> (tab % 32)) & 1
    assert "\\x1f" in str(to_grammar(schema({"type": "string", "minLength": 2})))


def allowed(guide: object, token: int, vocab_size: int = 4096) -> bool:
    bitmask = fill_bitmask([guide], vocab_size)  # type: ignore[list-item]
    assert bitmask is not None
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("kind", ["schema", "object"])
def test_json_is_compact_unless_whitespace_is_allowed(model_dir: pathlib.Path, kind: str) -> None:
    # A model free to choose whitespace may spend its max_tokens on newlines between keys:
    # by default nothing but ": " and ", " separates JSON tokens; json_whitespace=n allows up
    # to n whitespace characters between two tokens, and no more.
    grammars = Grammars.from_model_dir(model_dir, 4096, [1, 3])
    vocab = grammars.decoded_vocab
    brace, newline, space = (vocab.index(t) for t in (b"{", b"\n", b" "))
    guided = (schema({"type": "object", "properties": {"a": {"type": "integer"}}})
              if kind == "schema" else GuidedDecoding(GuidedKind.JSON_OBJECT))
    compact = grammars.guide(guided, [])
    assert compact.accept(brace)
    assert not allowed(compact, newline) and not allowed(compact, space)
    loose = grammars.guide(dataclasses.replace(guided, json_whitespace=3), [])
    assert loose.accept(brace) and allowed(loose, newline)
    for _ in range(3):
        assert loose.accept(space)
    assert not allowed(loose, space) and not allowed(loose, newline)


def test_json_numbers_end_within_int64_digits(model_dir: pathlib.Path) -> None:
    # xgrammar allows any count of digits; a model that keeps choosing them must still end.
    grammars = Grammars.from_model_dir(model_dir, 4096, [1, 3])
    one, zero = (grammars.decoded_vocab.index(t) for t in (b"1", b"0"))
    guide = grammars.guide(schema({"type": "integer"}), [])
    assert guide.accept(one)
    for _ in range(18):
        assert guide.accept(zero)
    assert not allowed(guide, zero)
    fraction = grammars.guide(schema({"type": "number"}), [])
    assert fraction.accept(zero) and fraction.accept(grammars.decoded_vocab.index(b"."))
    for _ in range(18):
        assert fraction.accept(one)
    assert not allowed(fraction, one)


def bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each row's bits over the vocabulary (those past it, in the last word, mean nothing)."""
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    return ((words.unsqueeze(-1) >> torch.arange(32)) & 1).flatten(1)[:, :vocab_size]


@pytest.mark.parametrize("model_vocab", [4096, 4100, 5000, 128256])
def test_masks_of_a_padded_vocabulary_match_xgrammars_bit_for_bit(
        model_dir: pathlib.Path, tokenizer: object, model_vocab: int) -> None:
    # xgrammar matches against the tokenizer's 4096 ids; the model's padding ids past them are
    # written 0 by fill_bitmask. The masks, accepts and stops must be those of an xgrammar
    # vocabulary padded to the model's, as before (issue 25).
    import random

    import xgrammar

    grammars = Grammars.from_model_dir(model_dir, model_vocab, [1, 3])
    assert grammars.vocab_size == model_vocab
    padded = Grammars(xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=model_vocab, stop_token_ids=[1, 3]))
    rng = random.Random(model_vocab)
    for guided in [schema(s) for s in SCHEMAS] + [GuidedDecoding(GuidedKind.REGEX, "[a-z]{1,9}")]:
        for _ in range(2):
            # Several guides per batch (the batch fill), one unconstrained row among them.
            news = [grammars.guide(guided, []) for _ in range(3)]
            olds = [padded.guide(guided, []) for _ in range(3)]
            for _ in range(40):
                live = [i for i in range(3) if not olds[i].is_terminated]
                if not live:
                    break
                new_mask = fill_bitmask([None] + [news[i] for i in live], model_vocab)
                old_mask = fill_bitmask([None] + [olds[i] for i in live], model_vocab)
                assert new_mask is not None and old_mask is not None
                assert torch.equal(bits(new_mask, model_vocab), bits(old_mask, model_vocab))
                for row, i in enumerate(live, 1):
                    single = fill_bitmask([news[i]], model_vocab)
                    assert single is not None
                    assert torch.equal(bits(single, model_vocab)[0],
                                       bits(old_mask, model_vocab)[row])
                    ids = allowed_ids(old_mask, row, model_vocab)
                    assert all(t < 4096 for t in ids)
                    for pad in {4096, model_vocab - 1} if model_vocab > 4096 else ():
                        assert not news[i].accept(pad) and not olds[i].accept(pad)
                    token = rng.choice(ids)
                    assert news[i].accept(token) and olds[i].accept(token)
                    assert news[i].is_terminated == olds[i].is_terminated


def test_deferred_tokens_move_a_guide_as_accepts_do(model_dir: pathlib.Path) -> None:
    # The engine defers the tokens it sampled under a mask (Guide.defer): the next fill takes
    # them first, in one batch, and the masks are those of guides that accepted each token at
    # once; a stop token ends the grammar at once; a deferred token the grammar forbids
    # fails the next defer or accept.
    import random

    grammars = Grammars.from_model_dir(model_dir, 4096, [1, 3])
    rng = random.Random(0)
    guided = schema(SCHEMAS[1])
    deferred = [grammars.guide(guided, []) for _ in range(6)]
    eager = [grammars.guide(guided, []) for _ in range(6)]
    for _ in range(80):
        live = [i for i in range(6) if not eager[i].is_terminated]
        assert live == [i for i in range(6) if not deferred[i].is_terminated]
        if not live:
            break
        got = fill_bitmask([deferred[i] for i in live], 4096)
        expected = fill_bitmask([eager[i] for i in live], 4096)
        assert got is not None and expected is not None
        assert torch.equal(bits(got, 4096), bits(expected, 4096))
        for row, i in enumerate(live):
            token = rng.choice(allowed_ids(expected, row, 4096))
            assert eager[i].accept(token) and deferred[i].defer(token)
    assert all(g.is_terminated for g in deferred)
    guide = grammars.guide(guided, [])
    assert guide.defer(grammars.decoded_vocab.index(b"x"))  # not a JSON object's start
    assert fill_bitmask([guide], 4096) is not None
    assert not guide.defer(grammars.decoded_vocab.index(b"{"))
    assert not guide.accept(grammars.decoded_vocab.index(b"{"))


def test_compiled_grammars_are_cached_by_constraint(model_dir: pathlib.Path) -> None:
    grammars = Grammars.from_model_dir(model_dir, 4096, [1])
    grammars._cache_size = 2
    a, b, c = (GuidedDecoding(GuidedKind.REGEX, p) for p in ("a+", "b+", "c+"))
    grammars.compile(a)
    grammars.compile(dataclasses.replace(a, num_output_tokens_in_prompt=3))  # same grammar
    assert (grammars.num_compiled, grammars.num_hits) == (1, 1)
    grammars.compile(b)
    grammars.compile(c)  # evicts a, the least recently used
    grammars.compile(a)
    assert grammars.num_compiled == 4 and len(grammars._cache) == 2
    with pytest.raises(InvalidRequest) as info:
        grammars.compile(GuidedDecoding(GuidedKind.GRAMMAR, "root ::= nothing"))
    assert info.value.param == "sampling.guided_decoding.grammar"


async def test_preemption_recomputes_without_moving_the_grammar_twice(
        model_dir: pathlib.Path) -> None:
    # Three 30-token prompts take 12 blocks of a 16-block pool (8 tokens a block); as their
    # outputs grow the newest is preempted and recomputed. Seeded draws depend only on (seed,
    # position), so the outputs must equal those of a roomy pool, and a token taken twice by a
    # grammar would change (or break) them.
    guided = schema(SCHEMAS[1])
    prompts = [[5 + (i * 7 + j) % 4000 for j in range(30 + i)] for i in range(3)]
    outputs = []
    for blocks in (512, 16):
        engine = reference(model_dir, num_gpu_blocks=blocks)
        await engine.start()
        try:
            outputs.append(await generate(engine, [request(f"p{i}", p, guided, i, 90)
                                                   for i, p in enumerate(prompts)]))
            preempted = engine.scheduler.num_preemptions
        finally:
            await engine.close()
    assert preempted > 0
    assert outputs[0] == outputs[1]
    assert any(finish == FinishReason.STOP for _, finish in outputs[1])


@pytest.mark.parametrize("make", [reference, mock])
async def test_a_migrated_request_continues_its_grammar(make, model_dir: pathlib.Path) -> None:  # noqa: ANN001
    guided = schema(SCHEMAS[0])
    prompt = [5, 60, 70, 80]
    engine = make(model_dir)
    await engine.start()
    try:
        [(whole, _)] = await generate(engine, [request("w", prompt, guided, 0, temperature=0)])
        k = len(whole) // 2
        moved = dataclasses.replace(guided, num_output_tokens_in_prompt=k)
        [(rest, finish)] = await generate(engine, [request(
            "m", prompt + whole[:k], moved, 0, MAX_TOKENS - k, temperature=0)])
        if make is reference:  # greedy: the same context gives the same tokens
            assert rest == whole[k:]
        assert finish == FinishReason.STOP
        # Tokens the grammar cannot have produced are refused before anything runs.
        bad = dataclasses.replace(guided, num_output_tokens_in_prompt=2)
        with pytest.raises(InvalidRequest) as info:
            engine.add_request(request("b", prompt + [whole[1], whole[0]], bad, 0))
        assert info.value.param == "sampling.guided_decoding.num_output_tokens_in_prompt"
    finally:
        await engine.close()


async def test_the_decode_worker_takes_the_prefill_workers_first_token(
        model_dir: pathlib.Path) -> None:
    prefill, decode = mock(model_dir), mock(model_dir)
    for engine in (prefill, decode):
        await engine.start()
    decode.set_lease_releaser(lambda h: prefill.leases.release(h.request_id))
    try:
        guided = schema(SCHEMAS[2])
        prompt = [5, 60, 70, 80]
        [(agg, _)] = await generate(decode, [request("a", prompt, guided, 3)])
        first = await prefill.prefill(request("d", prompt, guided, 3), lease_ms=30_000)
        assert first.first_token.token_id == agg[0] and first.kv_handle is not None
        resumed = dataclasses.replace(request("d", prompt, guided, 3),
                                      kv_handle=first.kv_handle, first_token=first.first_token)
        [(tokens, finish)] = await generate(decode, [resumed])
        assert tokens == agg and finish == FinishReason.STOP
        # A first token the grammar forbids (the output must open with '{') fails the request.
        first = await prefill.prefill(request("e", prompt, guided, 3), lease_ms=30_000)
        wrong = dataclasses.replace(first.first_token, token_id=agg[-2])
        bad = dataclasses.replace(request("e", prompt, guided, 3), kv_handle=first.kv_handle,
                                  first_token=wrong)
        with pytest.raises(FailedPrecondition) as info:
            await generate(decode, [bad])
        assert info.value.param == "first_token"
    finally:
        for engine in (prefill, decode):
            await engine.close()


async def test_min_tokens_cannot_hold_back_a_completed_grammar(model_dir: pathlib.Path) -> None:
    # Once "yes" or "no" is out the grammar allows only EOS; min_tokens must not mask it.
    engine = reference(model_dir)
    await engine.start()
    try:
        choice = GuidedDecoding(GuidedKind.CHOICE, choices=("yes", "no"))
        params = SamplingParams(max_tokens=20, min_tokens=20, ignore_eos=True, seed=0,
                                guided=choice, top_logprobs=2)
        tokens, finish = [], None
        logprobs = []
        async for chunk in engine.add_request(EngineRequest("m", (5, 6), params)):
            tokens += chunk.token_ids
            logprobs += chunk.logprobs
            finish = chunk.finish_reason
        assert finish == FinishReason.STOP and len(tokens) <= 3
        # Logprobs are those of the masked logits: at the end only the EOS ids (1 and 3 in the
        # demo vocabulary) are left, and they share all the mass.
        last = logprobs[-1]
        assert {alt.token_id for alt in last.top} == {1, 3} and last.token_id in (1, 3)
        assert sum(math.exp(alt.logprob) for alt in last.top) == pytest.approx(1.0, abs=1e-4)
    finally:
        await engine.close()


async def test_guided_decoding_can_be_turned_off(model_dir: pathlib.Path) -> None:
    engine = mock(model_dir, guided_decoding_backend="none")
    with pytest.raises(FailedPrecondition):
        engine.add_request(request("x", [5], GuidedDecoding(GuidedKind.JSON_OBJECT), 0))
    with pytest.raises(InvalidRequest):
        mock(model_dir, guided_decoding_backend="llguidance")


def test_a_fill_split_into_chunks_is_the_serial_fill(model_dir: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch's accepts and fills may run in chunks on threads of their own (fill_chunks): the
    # masks are those of the serial fill bit for bit, unguided rows allow every token, and a
    # row whose grammar refused its deferred token or ended allows every token too.
    import random

    from tandem.engines.guided import matcher

    grammars = Grammars.from_model_dir(model_dir, 5000, [1, 3])
    rng = random.Random(1)
    guided = schema(SCHEMAS[1])
    chunked = [grammars.guide(guided, []) for _ in range(7)]
    serial = [grammars.guide(guided, []) for _ in range(7)]
    for _ in range(40):
        live = [i for i in range(7) if not serial[i].is_terminated]
        if len(live) < 4:
            break
        monkeypatch.setenv(matcher.FILL_CHUNKS_ENV, "3")
        got = fill_bitmask([None] + [chunked[i] for i in live], 5000,
                           out=torch.zeros((9, 157), dtype=torch.int32))
        monkeypatch.setenv(matcher.FILL_CHUNKS_ENV, "1")
        expected = fill_bitmask([None] + [serial[i] for i in live], 5000)
        assert got is not None and expected is not None and got.shape == expected.shape
        assert torch.equal(bits(got, 5000), bits(expected, 5000))
        assert bits(got, 5000)[0].all()
        for row, i in enumerate(live, start=1):
            token = rng.choice(allowed_ids(expected, row, 5000))
            assert serial[i].accept(token) and chunked[i].defer(token)
    refused = grammars.guide(guided, [])
    assert refused.defer(grammars.decoded_vocab.index(b"x"))  # not a JSON object's start
    monkeypatch.setenv(matcher.FILL_CHUNKS_ENV, "2")
    others = [grammars.guide(guided, []) for _ in range(4)]
    mask = fill_bitmask([refused, *others], 5000)
    assert mask is not None and refused.rejected is not None
    assert bits(mask, 5000)[0].all() and not bits(mask, 5000)[1].all()
