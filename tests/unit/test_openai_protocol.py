"""The OpenAI protocol layer: request validation, and response shapes as the official client
parses them (its pydantic types, and the real client over a mock HTTP transport)."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.engines.types import FinishReason, SamplingParams, TokenLogprob, TopLogprob, Usage
from tandem.errors import InvalidRequest
from tandem.frontend import openai_request as oai_request
from tandem.frontend import openai_response as oai_response

httpx = pytest.importorskip("httpx2")  # the transport the installed openai client is built on

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP: dict[str, Any] = {"model": "m", "prompt": "hi"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def chat(**fields: Any) -> dict[str, Any]:
    return {**CHAT, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {**COMP, **fields}


def msg(**fields: Any) -> dict[str, Any]:
    return {**CHAT, "messages": [fields]}


# --- bad requests: (kind, body, headers, param, words the message must contain) -----------------

BAD: list[tuple[str, Any, dict[str, str], str | None, str]] = [
    ("chat", [CHAT], {}, None, "JSON object, got array"),
    ("chat", "hello", {}, None, "JSON object, got string"),
    ("completion", None, {}, None, "JSON object, got null"),
    ("chat", {"messages": CHAT["messages"]}, {}, "model", "required"),
    ("chat", chat(model=3), {}, "model", "string"),
    ("chat", chat(model=""), {}, "model", "non-empty"),
    ("chat", {"model": "m"}, {}, "messages", "required"),
    ("chat", chat(messages=[]), {}, "messages", "empty"),
    ("chat", chat(messages="hi"), {}, "messages", "array"),
    ("chat", chat(messages=[3]), {}, "messages[0]", "object"),
    ("chat", msg(content="hi"), {}, "messages[0].role", "required"),
    ("chat", msg(role="wizard", content="hi"), {}, "messages[0].role", "'wizard'"),
    ("chat", msg(role=["user"], content="hi"), {}, "messages[0].role", "one of"),
    ("chat", msg(role="user"), {}, "messages[0].content", "required"),
    ("chat", msg(role="user", content=5), {}, "messages[0].content", "got integer"),
    ("chat", msg(role="user", content=[{"type": "image"}]), {}, "messages[0].content[0].type",
     "not an OpenAI content part"),
    ("chat", msg(role="user", content=[{"type": "image_url", "image_url": {"url": ""}}]), {},
     "messages[0].content[0].image_url.url", "non-empty string"),
    ("chat", msg(role="user", content=[IMAGE] * 17), {}, "messages", "at most 16 images"),
    ("chat", msg(role="user", content=[{"type": "text", "text": 3}]), {},
     "messages[0].content[0].text", "string"),
    ("chat", msg(role="user", content=[{"type": "input_audio"}]), {},
     "messages[0].content[0].type", "not supported"),
    ("chat", msg(role="user", content=[{"text": "x"}]), {},
     "messages[0].content[0].type", "required"),
    ("chat", msg(role="user", content=["x"]), {}, "messages[0].content[0]", "object"),
    ("chat", chat(max_tokens="ten"), {}, "max_tokens", "integer, got string"),
    ("chat", chat(max_tokens=0), {}, "max_tokens", ">= 1"),
    ("chat", chat(max_tokens=-5), {}, "max_tokens", ">= 1"),
    ("chat", chat(max_tokens=True), {}, "max_tokens", "integer, got boolean"),
    ("chat", chat(max_tokens=1.5), {}, "max_tokens", "integer, got number"),
    ("chat", chat(max_completion_tokens=0), {}, "max_completion_tokens", ">= 1"),
    ("completion", comp(max_tokens="10"), {}, "max_tokens", "integer"),
    ("chat", chat(temperature="hot"), {}, "temperature", "number, got string"),
    ("chat", chat(temperature=True), {}, "temperature", "number, got boolean"),
    ("chat", chat(temperature=2.5), {}, "temperature", "<= 2"),
    ("chat", chat(temperature=-0.1), {}, "temperature", ">= 0"),
    ("chat", chat(temperature=math.nan), {}, "temperature", "temperature"),
    ("chat", chat(top_p=0), {}, "top_p", "> 0"),
    ("chat", chat(top_p=1.01), {}, "top_p", "<= 1"),
    ("chat", chat(top_k=-2), {}, "top_k", ">= -1"),
    ("chat", chat(top_k=2.0), {}, "top_k", "integer"),
    ("chat", chat(min_p=1.5), {}, "min_p", "<= 1"),
    ("chat", chat(seed="7"), {}, "seed", "integer"),
    ("chat", chat(seed=7.0), {}, "seed", "integer"),
    ("chat", chat(seed=-1), {}, "seed", ">= 0"),
    ("chat", chat(seed=2**64), {}, "seed", "<="),
    ("chat", chat(stop=""), {}, "stop", "non-empty"),
    ("chat", chat(stop=["a", ""]), {}, "stop", "non-empty"),
    ("chat", chat(stop=["a", "b", "c", "d", "e"]), {}, "stop", "at most 4"),
    ("chat", chat(stop=[1]), {}, "stop", "strings"),
    ("chat", chat(stop=3), {}, "stop", "got integer"),
    ("chat", chat(stop_token_ids="1"), {}, "stop_token_ids", "array"),
    ("chat", chat(stop_token_ids=[-1]), {}, "stop_token_ids", "non-negative"),
    ("chat", chat(stop_token_ids=[True]), {}, "stop_token_ids", "integer"),
    ("chat", chat(logprobs=1), {}, "logprobs", "boolean"),
    ("chat", chat(top_logprobs=3), {}, "top_logprobs", "requires 'logprobs'"),
    ("chat", chat(logprobs=False, top_logprobs=3), {}, "top_logprobs", "requires"),
    ("chat", chat(logprobs=True, top_logprobs=21), {}, "top_logprobs", "<= 20"),
    ("completion", comp(logprobs=6), {}, "logprobs", "<= 5"),
    ("completion", comp(logprobs=True), {}, "logprobs", "integer"),
    ("chat", chat(n=17), {}, "n", "16"),
    ("completion", comp(n=100), {}, "n", "16"),
    ("chat", chat(n=0), {}, "n", ">= 1"),
    ("chat", chat(n="1"), {}, "n", "integer"),
    ("chat", chat(stream="yes"), {}, "stream", "boolean"),
    ("chat", chat(stream_options={"include_usage": True}), {}, "stream_options", "'stream'"),
    ("chat", chat(stream=True, stream_options=3), {}, "stream_options", "object"),
    ("chat", chat(stream=True, stream_options={"include_usage": "y"}), {},
     "stream_options.include_usage", "boolean"),
    ("chat", chat(ignore_eos="yes"), {}, "ignore_eos", "boolean"),
    ("chat", chat(min_tokens=-1), {}, "min_tokens", ">= 0"),
    ("chat", chat(speculative_decoding="false"), {}, "speculative_decoding", "boolean"),
    ("completion", comp(speculative_decoding=0), {}, "speculative_decoding", "boolean"),
    ("chat", chat(nvext={"speculative_decoding": "off"}), {}, "nvext.speculative_decoding",
     "boolean"),
    # The top-level switch wins, but a bad nvext copy is still a bad request.
    ("completion", comp(speculative_decoding=True, nvext={"speculative_decoding": 1}), {},
     "nvext.speculative_decoding", "boolean"),
    ("chat", chat(min_tokens=10, max_tokens=5), {}, "min_tokens", "exceed"),
    ("chat", chat(repetition_penalty=0), {}, "repetition_penalty", "> 0"),
    ("chat", chat(repetition_penalty="x"), {}, "repetition_penalty", "number"),
    ("chat", chat(frequency_penalty=2.5), {}, "frequency_penalty", "<= 2"),
    ("chat", chat(presence_penalty=-3), {}, "presence_penalty", ">= -2"),
    ("chat", chat(skip_special_tokens="no"), {}, "skip_special_tokens", "boolean"),
    ("completion", {"model": "m"}, {}, "prompt", "required"),
    ("completion", comp(prompt=["a", "b"]), {}, "prompt", "batched prompts are not supported"),
    ("completion", comp(prompt=[[1], [2]]), {}, "prompt", "batched prompts are not supported"),
    ("completion", comp(prompt=[]), {}, "prompt", "empty"),
    ("completion", comp(prompt=""), {}, "prompt", "empty"),
    ("completion", comp(prompt=[""]), {}, "prompt", "empty"),
    ("completion", comp(prompt=[1, -2]), {}, "prompt", "non-negative"),
    ("completion", comp(prompt=[1, "a"]), {}, "prompt", "token ids"),
    ("completion", comp(prompt=5), {}, "prompt", "got integer"),
    ("completion", comp(prompt={"text": "hi"}), {}, "prompt", "got object"),
    ("completion", comp(echo=True), {}, "echo", "not supported"),
    ("completion", comp(echo="no"), {}, "echo", "not supported"),
    ("chat", chat(best_of=2), {}, "best_of", "completions only"),
    ("completion", comp(best_of=2, n=3), {}, "best_of", "at least 'n'"),
    ("completion", comp(best_of=3, stream=True), {}, "best_of", "stream"),
    ("completion", comp(best_of=17), {}, "best_of", "16"),
    ("completion", comp(suffix="end"), {}, "suffix", "not supported"),
    ("chat", chat(nvext=3), {}, "nvext", "object"),
    ("chat", chat(nvext={"top_k": "x"}), {}, "nvext.top_k", "integer"),
    ("chat", chat(nvext={"min_tokens": -1}), {}, "nvext.min_tokens", ">= 0"),
    ("chat", chat(nvext={"ignore_eos": 1}), {}, "nvext.ignore_eos", "boolean"),
    ("chat", chat(nvext={"repetition_penalty": 0}), {}, "nvext.repetition_penalty", "> 0"),
    ("chat", chat(nvext={"greed_sampling": 1}), {}, "nvext.greed_sampling", "boolean"),
    ("chat", chat(nvext={"router": []}), {}, "nvext.router", "object"),
    ("chat", chat(nvext={"router": {"ttft_target": -5}}), {}, "nvext.router.ttft_target", "> 0"),
    ("chat", chat(nvext={"router": {"itl_target": "fast"}}), {}, "nvext.router.itl_target",
     "number"),
    ("chat", CHAT, {"x-slo-ttft-ms": "abc"}, "x-slo-ttft-ms", "'abc'"),
    ("chat", CHAT, {"x-slo-ttft-ms": "-5"}, "x-slo-ttft-ms", "positive"),
    ("chat", CHAT, {"x-slo-ttft-ms": "inf"}, "x-slo-ttft-ms", "positive"),
    ("completion", COMP, {"X-Slo-Tpot-Ms": "0"}, "x-slo-tpot-ms", "positive"),
]


@pytest.mark.parametrize(("kind", "body", "headers", "param", "words"), BAD)
def test_bad_request_names_the_field(
    kind: oai_request.Kind, body: Any, headers: dict[str, str], param: str | None, words: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        oai_request.parse_request(body, kind, headers)
    assert info.value.param == param
    if param is not None:
        assert param in info.value.message
    assert words in info.value.message


def test_unknown_kind_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        oai_request.parse_request(CHAT, "embeddings", {})  # type: ignore[arg-type]


# --- good requests --------------------------------------------------------------------------------


def test_minimal_chat_takes_the_defaults() -> None:
    req = oai_request.parse_request(CHAT, "chat", {})
    assert req.kind == "chat" and req.model == "m"
    assert req.messages == ({"role": "user", "content": "hi"},)
    assert req.prompt is None and req.max_tokens is None and req.logprobs is None
    assert (req.stream, req.include_usage, req.stop, req.ttft_target_ms) == (False, False, (), None)
    assert req.sampling(16) == SamplingParams(max_tokens=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.model = "other"  # type: ignore[misc]


def test_chat_messages_text_parts_roles_and_extra_fields() -> None:
    body = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "name": "ann", "content": [
                {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "t", "type": "function",
                 "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "t", "content": "42"},
        ],
        user="someone", logit_bias={}, frobnicate=True,
    )
    assert oai_request.parse_request(body, "chat").messages == (
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "t"},
    )


def test_image_parts_become_template_parts_and_image_refs_in_order() -> None:
    body = chat(messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "compare"}, IMAGE,
            {"type": "input_image", "image_url": "https://example.com/b.png"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": "file:///x/c.png"}]},
    ])
    parsed = oai_request.parse_request(body, "chat")
    assert parsed.messages == (
        {"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"},
                                     {"type": "image"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image"}]},
    )
    assert [(i.url, i.param) for i in parsed.images] == [
        ("data:image/png;base64,AAAA", "messages[0].content[1]"),
        ("https://example.com/b.png", "messages[0].content[2]"),
        ("file:///x/c.png", "messages[2].content[0]")]


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_tokens": 7}, 7),
    ({"max_completion_tokens": 9}, 9),
    ({"max_completion_tokens": 9, "max_tokens": 7}, 9),
    ({"max_completion_tokens": None, "max_tokens": 7}, 7),
])
def test_chat_max_tokens_precedence(fields: dict[str, Any], expected: int) -> None:
    assert oai_request.parse_request(chat(**fields), "chat").max_tokens == expected


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": None, "top_logprobs": None}, None),
    ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5),
    ({"logprobs": True, "top_logprobs": 20}, 20),
])
def test_chat_logprobs(fields: dict[str, Any], expected: int | None) -> None:
    req = oai_request.parse_request(chat(**fields), "chat")
    assert req.logprobs == expected and req.sampling(1).top_logprobs == expected


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], (1, 2, 3)), ([[4, 5]], (4, 5)),
])
def test_completion_prompt(prompt: Any, expected: str | tuple[int, ...]) -> None:
    req = oai_request.parse_request(comp(prompt=prompt, echo=False, n=1, logprobs=3), "completion")
    assert req.kind == "completion" and req.prompt == expected and req.logprobs == 3
    assert req.messages == ()


def test_stream_and_usage() -> None:
    req = oai_request.parse_request(chat(stream=True, stream_options={"include_usage": True}), "chat")
    assert req.stream and req.include_usage
    req = oai_request.parse_request(chat(stream=True, stream_options={}), "chat")
    assert req.stream and not req.include_usage
    assert not oai_request.parse_request(chat(stream_options=None), "chat").include_usage


def test_sampling_fields_and_vllm_extras() -> None:
    body = comp(
        max_tokens=50, temperature=1, top_p=0.9, top_k=40, min_p=0.05, seed=2**63,
        stop=["\n\n", "END"], stop_token_ids=[7, 8], frequency_penalty=-0.5,
        presence_penalty=1.5, repetition_penalty=1.1, min_tokens=3, ignore_eos=True,
        skip_special_tokens=False, logprobs=0,
    )
    req = oai_request.parse_request(body, "completion")
    assert isinstance(req.temperature, float) and req.stop == ("\n\n", "END")
    assert not req.skip_special_tokens
    assert req.sampling(50) == SamplingParams(
        max_tokens=50, temperature=1.0, top_p=0.9, top_k=40, min_p=0.05, seed=2**63,
        repetition_penalty=1.1, frequency_penalty=-0.5, presence_penalty=1.5,
        stop_token_ids=(7, 8), min_tokens=3, ignore_eos=True, top_logprobs=0,
    )


def test_single_stop_string_and_top_k_minus_one() -> None:
    req = oai_request.parse_request(chat(stop="###", top_k=-1), "chat")
    assert req.stop == ("###",) and req.top_k == 0 and req.sampling(1).top_k == 0


def test_nvext_fields_apply_when_top_level_is_absent() -> None:
    nvext = {"ignore_eos": True, "top_k": 5, "min_tokens": 2, "repetition_penalty": 1.3,
             "router": {"ttft_target": 200, "itl_target": 25.5}, "annotations": ["x"]}
    req = oai_request.parse_request(chat(nvext=nvext), "chat")
    assert (req.ignore_eos, req.top_k, req.min_tokens, req.repetition_penalty) == (True, 5, 2, 1.3)
    assert (req.ttft_target_ms, req.itl_target_ms) == (200.0, 25.5)


def test_top_level_wins_over_nvext() -> None:
    body = chat(ignore_eos=False, top_k=9, min_tokens=0, repetition_penalty=1.0,
                nvext={"ignore_eos": True, "top_k": 5, "min_tokens": 2, "repetition_penalty": 1.3})
    req = oai_request.parse_request(body, "chat")
    assert (req.ignore_eos, req.top_k, req.min_tokens, req.repetition_penalty) == (False, 9, 0, 1.0)


@pytest.mark.parametrize(("kind", "fields", "expected"), [
    ("chat", {}, True),
    ("chat", {"speculative_decoding": False}, False),
    ("completion", {"speculative_decoding": False}, False),
    ("completion", {"speculative_decoding": True}, True),
    ("chat", {"speculative_decoding": None}, True),
    ("chat", {"nvext": {"speculative_decoding": False}}, False),
    ("completion", {"speculative_decoding": True, "nvext": {"speculative_decoding": False}}, True),
    ("chat", {"speculative_decoding": False, "nvext": {"speculative_decoding": True}}, False),
])
def test_speculative_decoding_switch(kind: oai_request.Kind, fields: dict[str, Any],
                                     expected: bool) -> None:
    body = chat(**fields) if kind == "chat" else comp(**fields)
    req = oai_request.parse_request(body, kind)
    assert req.speculative is expected
    assert req.sampling(4).speculative is expected


@pytest.mark.parametrize(("fields", "expected"), [
    ({"nvext": {"greed_sampling": True}}, 0.0),
    ({"temperature": 0.8, "nvext": {"greed_sampling": True}}, 0.0),
    ({"temperature": 0.8, "nvext": {"greed_sampling": False}}, 0.8),
    ({"nvext": {}}, None),
])
def test_greed_sampling(fields: dict[str, Any], expected: float | None) -> None:
    req = oai_request.parse_request(chat(**fields), "chat")
    assert req.temperature == expected
    assert req.sampling(1).is_greedy == (expected == 0.0)


def test_sla_headers_and_precedence() -> None:
    headers = {"X-SLO-TTFT-MS": "150", "x-slo-tpot-ms": "12.5", "x-other": "junk"}
    req = oai_request.parse_request(CHAT, "chat", headers)
    assert (req.ttft_target_ms, req.itl_target_ms) == (150.0, 12.5)
    body = chat(nvext={"router": {"ttft_target": 300}})
    req = oai_request.parse_request(body, "chat", headers)
    assert (req.ttft_target_ms, req.itl_target_ms) == (300.0, 12.5)


# --- response shapes --------------------------------------------------------------------------

CID, MODEL, CREATED = "chatcmpl-abc", "m", 1_700_000_000
USAGE = Usage(prompt_tokens=11, completion_tokens=3, cached_tokens=8,
              accepted_prediction_tokens=2, rejected_prediction_tokens=5)
VOCAB = {1: "Hel", 2: "lo", 3: "!", 4: "é", 5: "lo"}
LOGPROBS = [
    TokenLogprob(1, -0.1, (TopLogprob(1, -0.1), TopLogprob(4, -2.5))),
    TokenLogprob(2, -math.inf, (TopLogprob(5, -0.3), TopLogprob(2, -0.4))),
    TokenLogprob(3, -0.7, ()),
]


def as_json(body: dict[str, Any]) -> str:
    return json.dumps(body, allow_nan=False)  # what the wire carries; -inf must not leak


def test_ids_and_created() -> None:
    a, b = oai_response.new_completion_id("chat"), oai_response.new_completion_id("chat")
    assert a.startswith("chatcmpl-") and len(a) == len("chatcmpl-") + 32 and a != b
    assert oai_response.new_completion_id("completion").startswith("cmpl-")
    assert abs(oai_response.created_now() - time.time()) < 2


def test_every_finish_reason_maps_to_an_openai_value() -> None:
    assert set(oai_response.FINISH_REASONS) == set(FinishReason)
    assert oai_response.FINISH_REASONS[FinishReason.STOP] == "stop"
    assert oai_response.FINISH_REASONS[FinishReason.LENGTH] == "length"
    assert oai_response.FINISH_REASONS[FinishReason.CANCELLED] == "stop"


@pytest.mark.parametrize("reason", list(FinishReason))
def test_chat_completion_parses(reason: FinishReason) -> None:
    logprobs = oai_response.chat_logprobs(LOGPROBS, VOCAB.__getitem__)
    body = oai_response.chat_completion(CID, MODEL, CREATED, "Hello!", reason, USAGE, logprobs)
    parsed = ChatCompletion.model_validate_json(as_json(body))
    choice = parsed.choices[0]
    assert (parsed.id, parsed.model, parsed.created, parsed.object) == (
        CID, MODEL, CREATED, "chat.completion")
    assert choice.message.role == "assistant" and choice.message.content == "Hello!"
    assert choice.finish_reason == oai_response.FINISH_REASONS[reason]
    assert parsed.usage is not None and parsed.usage.total_tokens == 14
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8  # type: ignore[union-attr]
    details = parsed.usage.completion_tokens_details
    assert details is not None
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (2, 5)
    content = choice.logprobs.content  # type: ignore[union-attr]
    assert [c.token for c in content] == ["Hel", "lo", "!"]  # type: ignore[union-attr]
    assert content[1].logprob == -9999.0  # type: ignore[index]
    assert content[0].top_logprobs[1].token == "é"  # type: ignore[index]
    assert content[0].top_logprobs[1].bytes == list("é".encode())  # type: ignore[index]
    assert content[2].top_logprobs == []  # type: ignore[index]


def test_chat_stream_chunks_parse() -> None:
    chunks = [
        oai_response.chat_chunk_first(CID, MODEL, CREATED),
        oai_response.chat_chunk(CID, MODEL, CREATED, "Hel"),
        oai_response.chat_chunk(CID, MODEL, CREATED, "lo!", oai_response.chat_logprobs(LOGPROBS[1:], VOCAB.get)),
        oai_response.chat_chunk_last(CID, MODEL, CREATED, FinishReason.LENGTH),
        oai_response.chat_chunk_usage(CID, MODEL, CREATED, USAGE),
    ]
    parsed = [ChatCompletionChunk.model_validate_json(as_json(c)) for c in chunks]
    assert all(p.object == "chat.completion.chunk" and p.id == CID for p in parsed)
    first, last, usage = parsed[0].choices[0], parsed[3].choices[0], parsed[4]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert "".join(p.choices[0].delta.content or "" for p in parsed[:4]) == "Hello!"
    assert parsed[2].choices[0].logprobs.content[0].token == "lo"  # type: ignore[union-attr]
    assert last.finish_reason == "length" and chunks[3]["choices"][0]["delta"] == {}
    assert all(p.choices[0].finish_reason is None for p in parsed[:3])
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.prompt_tokens_details.cached_tokens == 8  # type: ignore[union-attr]
    details = usage.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens == 2


def test_completion_logprobs_shape_and_offsets() -> None:
    body, offset = oai_response.completion_logprobs(LOGPROBS[:2], VOCAB.__getitem__, text_offset=4)
    assert body == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.1, -9999.0],
        # the sampled token is always present; "lo" (ids 5 and 2) appears once, the likelier
        "top_logprobs": [{"Hel": -0.1, "é": -2.5}, {"lo": -0.3}],
        "text_offset": [4, 7],
    }
    assert offset == 9
    body, _ = oai_response.completion_logprobs(LOGPROBS[2:], VOCAB.__getitem__, offset)
    assert body["top_logprobs"] == [{"!": -0.7}] and body["text_offset"] == [9]


def test_text_completion_and_chunks_parse() -> None:
    logprobs, _ = oai_response.completion_logprobs(LOGPROBS, VOCAB.__getitem__)
    body = oai_response.text_completion("cmpl-1", MODEL, CREATED, "Hello!", FinishReason.STOP, USAGE,
                                 logprobs)
    parsed = Completion.model_validate_json(as_json(body))
    assert parsed.object == "text_completion" and parsed.choices[0].text == "Hello!"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.choices[0].logprobs.tokens == ["Hel", "lo", "!"]  # type: ignore[union-attr]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8  # type: ignore[union-attr]
    chunks = [
        oai_response.completion_chunk("cmpl-1", MODEL, CREATED, "Hel"),
        oai_response.completion_chunk("cmpl-1", MODEL, CREATED, "lo!", logprobs),
        oai_response.completion_chunk("cmpl-1", MODEL, CREATED, "", None, FinishReason.LENGTH),
        oai_response.completion_chunk_usage("cmpl-1", MODEL, CREATED, USAGE),
    ]
    # Mid-stream chunks carry finish_reason null, as OpenAI's and vLLM's do: the strict model
    # refuses null (the client parses stream chunks leniently; see the round trip below).
    assert [c["choices"][0]["finish_reason"] for c in chunks[:2]] == [None, None]
    last = Completion.model_validate_json(as_json(chunks[2]))
    assert last.choices[0].finish_reason == "length" and last.choices[0].text == ""
    usage = Completion.model_validate_json(as_json(chunks[3]))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 14


# --- the official client end to end over a mock transport -------------------------------------


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return "".join(f"data: {as_json(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def client_for(handler: Any) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(api_key="k", base_url="http://tandem.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=transport))


def test_official_client_chat_stream_round_trip() -> None:
    seen: list[oai_request.ParsedRequest] = []

    def handler(request: Any) -> Any:
        req = oai_request.parse_request(json.loads(request.content), "chat", request.headers)
        seen.append(req)
        cid, created = oai_response.new_completion_id("chat"), oai_response.created_now()
        chunks = [oai_response.chat_chunk_first(cid, req.model, created)]
        chunks += [oai_response.chat_chunk(cid, req.model, created, t) for t in ("Hel", "lo", "!")]
        chunks.append(oai_response.chat_chunk_last(cid, req.model, created, FinishReason.STOP))
        if req.include_usage:
            chunks.append(oai_response.chat_chunk_usage(cid, req.model, created, USAGE))
        return httpx.Response(200, content=sse(chunks),
                              headers={"content-type": "text/event-stream"})

    stream = client_for(handler).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=8, seed=3, stop=["x"],
        extra_headers={"x-slo-ttft-ms": "250"},
        extra_body={"nvext": {"top_k": 4}, "speculative_decoding": False},
    )
    received = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert text == "Hello!"
    assert [c.choices[0].finish_reason for c in received if c.choices][-1] == "stop"
    assert received[-1].usage is not None and received[-1].usage.completion_tokens == 3
    details = received[-1].usage.completion_tokens_details
    assert details is not None
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (2, 5)
    req = seen[0]
    assert (req.max_tokens, req.seed, req.stop, req.top_k) == (8, 3, ("x",), 4)
    assert req.include_usage and req.ttft_target_ms == 250.0
    assert req.sampling(8).speculative is False


def test_official_client_completion_round_trip() -> None:
    def handler(request: Any) -> Any:
        req = oai_request.parse_request(json.loads(request.content), "completion", request.headers)
        logprobs, _ = oai_response.completion_logprobs(LOGPROBS, VOCAB.__getitem__)
        body = oai_response.text_completion(oai_response.new_completion_id("completion"), req.model,
                                     oai_response.created_now(), "Hello!", FinishReason.LENGTH, USAGE,
                                     logprobs if req.logprobs is not None else None)
        return httpx.Response(200, json=body)

    result = client_for(handler).completions.create(model="m", prompt=[1, 2, 3], logprobs=2)
    assert result.choices[0].text == "Hello!" and result.choices[0].finish_reason == "length"
    assert result.choices[0].logprobs.text_offset == [0, 3, 5]  # type: ignore[union-attr]
    assert result.usage.prompt_tokens_details.cached_tokens == 8  # type: ignore[union-attr]


def test_official_client_completion_stream_round_trip() -> None:
    def handler(request: Any) -> Any:
        req = oai_request.parse_request(json.loads(request.content), "completion", request.headers)
        cid, created, offset = oai_response.new_completion_id("completion"), oai_response.created_now(), 0
        chunks = []
        for lp in LOGPROBS:
            logprobs, offset = oai_response.completion_logprobs([lp], VOCAB.__getitem__, offset)
            chunks.append(oai_response.completion_chunk(cid, req.model, created, VOCAB[lp.token_id],
                                                 logprobs))
        chunks.append(oai_response.completion_chunk(cid, req.model, created, "", None,
                                             FinishReason.STOP))
        if req.include_usage:
            chunks.append(oai_response.completion_chunk_usage(cid, req.model, created, USAGE))
        return httpx.Response(200, content=sse(chunks),
                              headers={"content-type": "text/event-stream"})

    stream = client_for(handler).completions.create(
        model="m", prompt="hi", stream=True, stream_options={"include_usage": True}, logprobs=1)
    received = list(stream)
    with_choices = [c for c in received if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == "Hello!"
    assert [c.choices[0].finish_reason for c in with_choices] == [None, None, None, "stop"]
    logprobs = [c.choices[0].logprobs for c in with_choices[:3]]
    assert [lp.text_offset for lp in logprobs] == [[0], [3], [5]]  # type: ignore[union-attr]
    assert received[-1].usage is not None and received[-1].usage.total_tokens == 14
