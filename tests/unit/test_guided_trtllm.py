"""Structured outputs on the trtllm engine against the fake TensorRT-LLM: constraints become
upstream's GuidedDecodingParams, guided decoding sets `guided_decoding_backend` (and keeps the
tokenizer TensorRT-LLM then needs), and the fake's xgrammar-backed decoder enforces them."""
from __future__ import annotations

import pathlib
import re

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.guided.grammar import to_grammar
from tandem.engines.trtllm.args import from_flags
from tandem.engines.trtllm.sampling import guided_kwargs
from tandem.engines.types import EngineRequest, FinishReason, GuidedDecoding, GuidedKind
from tandem.engines.types import SamplingParams as Sampling
from tandem.errors import FailedPrecondition, InvalidRequest
from tests.unit.fake_packages import fake_trtllm  # noqa: F401 (autouse: tensorrt_llm is the fake)


@pytest.mark.parametrize("guided, expected", [
    # JSON goes as the grammar the other engines compile: upstream's `json` and `json_object`
    # would allow unbounded whitespace (GuidedDecoding.json_whitespace).
    (GuidedDecoding(GuidedKind.JSON_SCHEMA, '{"type": "object"}'),
     {"grammar": str(to_grammar(GuidedDecoding(GuidedKind.JSON_SCHEMA, '{"type": "object"}')))}),
    (GuidedDecoding(GuidedKind.JSON_OBJECT, json_whitespace=2),
     {"grammar": str(to_grammar(GuidedDecoding(GuidedKind.JSON_OBJECT, json_whitespace=2)))}),
    (GuidedDecoding(GuidedKind.REGEX, "a+"), {"regex": "a+"}),
    (GuidedDecoding(GuidedKind.GRAMMAR, 'root ::= "a"'), {"grammar": 'root ::= "a"'}),
    (GuidedDecoding(GuidedKind.CHOICE, choices=("a", 'b"')), {"grammar": 'root ::= "a" | "b\\""'}),
])
def test_constraints_map_to_guided_decoding_params(guided: GuidedDecoding,
                                                   expected: dict[str, object]) -> None:
    from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

    assert guided_kwargs(guided) == expected
    params = SamplingParams(guided_decoding=GuidedDecodingParams(**guided_kwargs(guided)))
    assert params.guided_decoding is not None
    with pytest.raises(ValueError, match="Only one guide"):  # upstream's _validate
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a", grammar='root ::= "a"'))


def test_the_backend_flag_reaches_the_llm_args() -> None:
    on = from_flags(EngineArgs())
    assert on["guided_decoding_backend"] == "xgrammar" and on["skip_tokenizer_init"] is False
    off = from_flags(EngineArgs(guided_decoding_backend="none"))
    assert "guided_decoding_backend" not in off and off["skip_tokenizer_init"] is True


def test_the_fake_like_upstream_needs_a_tokenizer_for_guided_decoding(tiny_model: str) -> None:
    from tensorrt_llm import LLM

    with pytest.raises(AssertionError):
        LLM(model=tiny_model, skip_tokenizer_init=True, guided_decoding_backend="xgrammar")


async def test_guided_requests_follow_their_constraint(tmp_path: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    from tandem.engines.trtllm.engine import create_trtllm_engine
    from tandem.model.demo import ensure_demo_model

    model = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    engine = create_trtllm_engine(EngineArgs(model=str(model), kv_block_size=4))
    await engine.start()
    try:
        cases = {"r": GuidedDecoding(GuidedKind.REGEX, "[0-9]{3}-[a-z]{2}"),
                 "c": GuidedDecoding(GuidedKind.CHOICE, choices=("alpha", "beta"))}
        for rid, guided in cases.items():
            stream = engine.add_request(EngineRequest(rid, (5, 6, 7), Sampling(
                max_tokens=40, temperature=0.0, guided=guided)))
            tokens, finish = [], None
            async for chunk in stream:
                tokens += chunk.token_ids
                finish = chunk.finish_reason
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            assert finish == FinishReason.STOP
            assert (re.fullmatch(guided.spec, text) if guided.spec else text in guided.choices)
        moved = GuidedDecoding(GuidedKind.JSON_OBJECT, num_output_tokens_in_prompt=1)
        with pytest.raises(FailedPrecondition):  # upstream cannot continue a grammar
            engine.add_request(EngineRequest("m", (5, 6), Sampling(max_tokens=4, guided=moved)))
    finally:
        await engine.close()
    off = create_trtllm_engine(EngineArgs(model=str(model), guided_decoding_backend="none"))
    await off.start()
    try:
        with pytest.raises(FailedPrecondition):
            off.add_request(EngineRequest("x", (5,), Sampling(
                max_tokens=4, guided=GuidedDecoding(GuidedKind.JSON_OBJECT))))
    finally:
        await off.close()
    with pytest.raises(InvalidRequest):
        create_trtllm_engine(EngineArgs(model=str(model), guided_decoding_backend="outlines"))
