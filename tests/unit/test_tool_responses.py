"""Answers with tool calls and reasoning, built from fixed model text: streamed (in every
split) and whole, checked against the official `openai` client's types and its stream
accumulation, and the special-token handling of parsers whose markers are special tokens."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.engines.types import FinishReason, GuidedKind, TokenLogprob, Usage
from tandem.frontend.openai_request import parse_request
from tandem.frontend.openai_stream import OpenAIResponder
from tandem.frontend.output_parsers import OutputParsers
from tandem.frontend.parsers import reasoning_parser, tool_parser
from tandem.frontend.parsers.harmony_text import ALL_MARKERS
from tandem.frontend.pipeline import Delta
from tandem.frontend.special_text import SpecialTextFilter

httpx = pytest.importorskip("httpx2")  # the transport the installed openai client is built on

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
PARIS = '{"city": "Paris"}'
HERMES_TEXT = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS
               + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
HERMES = OutputParsers(tool_parser("hermes"), None, frozenset({"<|im_end|>"}))
R1 = OutputParsers(None, reasoning_parser("deepseek_r1"))
USAGE = Usage(7, 3)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def responder(parsers: OutputParsers, **fields: Any) -> OpenAIResponder:
    parsed = parse_request(body(**fields), "chat")
    return OpenAIResponder(parsed, "m", str, lambda: parsers.new_output(parsed))


def deltas(text: str, size: int, reason: FinishReason = FinishReason.STOP) -> list[Delta]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    out = [Delta(p, [1], []) for p in pieces]
    out[-1].finish_reason, out[-1].usage = reason, USAGE
    return out


def stream(r: OpenAIResponder, parts: list[Delta]) -> list[dict[str, Any]]:
    events = r.first_events()
    for delta in parts:
        events += r.delta_events(delta)
    for event in events:  # every chunk is one the official client parses
        ChatCompletionChunk.model_validate(event)
    return events


def whole(r: OpenAIResponder, parts: list[Delta]) -> ChatCompletion:
    async def gen() -> AsyncIterator[Delta]:
        for delta in parts:
            yield delta
    return ChatCompletion.model_validate(asyncio.run(r.collect(gen())))


def assemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client assembles from the chunks, the way OpenAI documents it."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            out["content"] += delta.get("content") or ""
            out["reasoning"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                if "id" in call:
                    slot["id"] = call["id"]
                slot["name"] += call.get("function", {}).get("name") or ""
                slot["arguments"] += call.get("function", {}).get("arguments") or ""
            out["finish"] = choice["finish_reason"] or out["finish"]
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_calls_stream_in_openai_shape_in_every_split(size: int) -> None:
    events = stream(responder(HERMES, tools=[WEATHER, TIME]), deltas(HERMES_TEXT, size))
    got = assemble(events)
    assert got["content"] == "Let me check."
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
        ("get_weather", PARIS), ("get_time", "{}")]
    assert got["finish"] == "tool_calls"
    entries = [e["choices"][0]["delta"]["tool_calls"][0] for e in events
               if e["choices"] and "tool_calls" in e["choices"][0]["delta"]]
    first = entries[0]
    assert first["id"].startswith("call_") and len(first["id"]) == 29
    assert first == {"index": 0, "id": first["id"], "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}
    assert entries[1] == {"index": 0, "function": {"arguments": PARIS}}
    assert entries[2]["index"] == 1 and entries[2]["function"] == {"name": "get_time",
                                                                   "arguments": ""}
    assert all("<" not in (e["choices"][0]["delta"].get("content") or "")
               for e in events if e["choices"])
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "tool_calls"}


def test_hermes_calls_whole_and_content_null_when_only_calls() -> None:
    reply = whole(responder(HERMES, tools=[WEATHER, TIME]), deltas(HERMES_TEXT, 5))
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        ("get_weather", PARIS), ("get_time", "{}")]
    only = whole(responder(HERMES, tools=[WEATHER]),
                 deltas(HERMES_TEXT.split("\n\n", 1)[1], 4))
    assert only.choices[0].message.content is None
    assert len(only.choices[0].message.tool_calls or []) == 2


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    got = assemble(stream(responder(HERMES, tools=[WEATHER, TIME], parallel_tool_calls=False),
                          deltas(HERMES_TEXT, 4)))
    assert [c["name"] for c in got["calls"].values()] == ["get_weather"]
    reply = whole(responder(HERMES, tools=[WEATHER, TIME], parallel_tool_calls=False),
                  deltas(HERMES_TEXT, 4))
    assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == [
        "get_weather"]


def test_without_tools_or_with_choice_none_markup_is_content() -> None:
    for fields in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        reply = whole(responder(HERMES, **fields), deltas(HERMES_TEXT, 4))
        assert reply.choices[0].message.content == HERMES_TEXT
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason == "stop"


def test_held_back_text_is_flushed_before_the_final_chunk() -> None:
    events = stream(responder(HERMES, tools=[WEATHER]), deltas("The answer: <tool_", 3))
    contents = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    assert "".join(c or "" for c in contents) == "The answer: <tool_"
    assert events[-2]["choices"][0]["delta"] == {"content": " <tool_"}  # whitespace held too
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_call_cut_by_max_tokens_is_content_and_length() -> None:
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    reply = whole(responder(HERMES, tools=[WEATHER]), deltas(cut, 4, FinishReason.LENGTH))
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == cut and not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_forced_choices_turn_the_json_output_into_calls(size: int) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for parsers in (HERMES, OutputParsers()):  # no parser needed
        got = assemble(stream(responder(parsers, tools=[WEATHER], tool_choice=named),
                              deltas(text, size)))
        assert got["content"] == "" and got["finish"] == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
            ("get_weather", {"city": "Paris"})]
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'
    reply = whole(responder(OutputParsers(), tools=[WEATHER, TIME], tool_choice="required"),
                  deltas(text, size))
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None
    assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == [
        "get_time", "get_weather"]
    cut = whole(responder(OutputParsers(), tools=[WEATHER, TIME], tool_choice="required"),
                deltas(text[:20], size, FinishReason.LENGTH))
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content == text[:20]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_reasoning_is_split_into_reasoning_content(size: int) -> None:
    text = "The user says hi.\nGreet back.\n</think>\n\nHello there!"
    got = assemble(stream(responder(R1), deltas(text, size)))
    assert (got["reasoning"], got["content"]) == ("The user says hi.\nGreet back.",
                                                  "Hello there!")
    reply = whole(responder(R1), deltas(text, size))
    message = reply.choices[0].message
    assert message.content == "Hello there!"
    assert message.model_extra == {"reasoning_content": "The user says hi.\nGreet back."}
    # Under a constraint the grammar holds from the first token: nothing is reasoning.
    reply = whole(responder(R1, guided_regex="[a-z]+"), deltas("abc", size))
    assert reply.choices[0].message.content == "abc"
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})


def test_reasoning_then_tool_calls() -> None:
    parsers = OutputParsers(tool_parser("hermes"), reasoning_parser("qwen3"))
    text = "<think>\nNeed the weather.\n</think>\n\n" + HERMES_TEXT.split("\n\n", 1)[1]
    got = assemble(stream(responder(parsers, tools=[WEATHER, TIME]), deltas(text, 3)))
    assert got["reasoning"] == "Need the weather." and got["content"] == ""
    assert [c["name"] for c in got["calls"].values()] == ["get_weather", "get_time"]


def test_logprobs_ride_on_the_first_chunk_of_their_delta() -> None:
    r = responder(HERMES, tools=[WEATHER], logprobs=True)
    lp = [TokenLogprob(1, -0.5)]
    events = r.delta_events(Delta("Hi <tool_call>\n", [1], lp))
    assert [e["choices"][0]["logprobs"]["content"][0]["logprob"] for e in events] == [-0.5]
    assert events[0]["choices"][0]["delta"] == {"content": "Hi"}
    held = r.delta_events(Delta('{"name": "get_weather"', [2], lp))  # inside the call region
    assert held[0]["choices"][0]["delta"] == {} and held[0]["choices"][0]["logprobs"]


# --- parsers whose markers are special tokens -------------------------------------------------

LLAMA_SPECIALS = frozenset({"<|python_tag|>", "<|eot_id|>", "<|eom_id|>", "<|begin_of_text|>"})
LLAMA = OutputParsers(tool_parser("llama3_json"), None, LLAMA_SPECIALS)


def test_special_markers_keep_special_tokens_and_the_others_are_removed() -> None:
    with_tools = parse_request(body(tools=[WEATHER]), "chat")
    assert not LLAMA.skip_special_tokens(with_tools)
    assert LLAMA.skip_special_tokens(parse_request(body(), "chat"))
    assert LLAMA.skip_special_tokens(parse_request(body(tools=[WEATHER], tool_choice="none"),
                                                   "chat"))
    assert HERMES.skip_special_tokens(with_tools)  # <tool_call> is not special here
    text = '<|python_tag|>{"name": "get_weather", "parameters": ' + PARIS + "}<|eom_id|>"
    for size in (1, 3, 1000):
        got = assemble(stream(responder(LLAMA, tools=[WEATHER]), deltas(text, size)))
        assert got["content"] == "" and got["finish"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
            ("get_weather", PARIS)]
        plain = whole(responder(LLAMA, tools=[WEATHER]), deltas("Sunny.<|eot_id|>", size))
        assert plain.choices[0].message.content == "Sunny."
    # A client that asked for special tokens keeps them.
    kept = whole(responder(LLAMA, tools=[WEATHER], skip_special_tokens=False),
                 deltas("Sunny.<|eot_id|>", 2))
    assert kept.choices[0].message.content == "Sunny.<|eot_id|>"


def test_markup_inside_a_call_region_survives_the_special_token_removal() -> None:
    mistral = OutputParsers(tool_parser("mistral"), None,
                            frozenset({"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "</s>", "[INST]"}))
    text = "[TOOL_CALLS]get_weather[ARGS]" + PARIS + "[TOOL_CALLS]get_time[ARGS]{}</s>"
    got = assemble(stream(responder(mistral, tools=[WEATHER, TIME]), deltas(text, 2)))
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
        ("get_weather", PARIS), ("get_time", "{}")]
    assert got["content"] == ""


HARMONY = OutputParsers(tool_parser("harmony"), reasoning_parser("gpt_oss"),
                        frozenset({*ALL_MARKERS, "<|endoftext|>"}))
#: A forced call as gpt-oss writes it under the harmony grammar (`<|call|>`, its EOS, unseen).
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                + PARIS)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_forced_choices_under_harmony_are_harmony_calls_read_by_the_parsers(size: int) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, tools in ((named, [WEATHER]), ("required", [WEATHER, TIME])):
        parsed = parse_request(body(tools=tools, tool_choice=choice), "chat")
        guided = HARMONY.forced_guided(parsed)
        assert guided is not None and guided.kind is GuidedKind.GRAMMAR
        assert "to=functions." in guided.spec
        assert not HARMONY.skip_special_tokens(parsed)  # the markers reach the parsers
        got = assemble(stream(responder(HARMONY, tools=tools, tool_choice=choice),
                              deltas(HARMONY_CALL, size)))
        assert (got["reasoning"], got["content"]) == ("Need the weather.", "")
        assert got["finish"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
            ("get_weather", PARIS)]
        reply = whole(responder(HARMONY, tools=tools, tool_choice=choice),
                      deltas(HARMONY_CALL, size))
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        assert official_calls(iter(message.tool_calls or [])) == [("get_weather", PARIS)]
    # Cut by max_tokens: the unfinished call is content, as under "auto".
    cut = whole(responder(HARMONY, tools=[WEATHER], tool_choice=named),
                deltas(HARMONY_CALL[:-4], size, FinishReason.LENGTH))
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert (cut.choices[0].message.content or "").endswith(PARIS[:-4])


def test_other_parsers_keep_bare_json_for_forced_choices() -> None:
    named = parse_request(body(tools=[WEATHER], tool_choice="required"), "chat")
    for parsers in (HERMES, LLAMA, OutputParsers()):
        assert parsers.forced_guided(named) is None
    assert named.guided is not None and named.guided.kind is GuidedKind.JSON_SCHEMA
    for fields in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        assert HARMONY.forced_guided(parse_request(body(tools=[WEATHER], **fields),
                                                   "chat")) is None


def test_special_text_filter_removes_split_strings() -> None:
    def run(parts: list[str]) -> str:
        f = SpecialTextFilter(["<|eot_id|>", "<|eom_id|>"])
        return "".join(f.feed(p) for p in parts) + f.finish()

    assert run(["a<|eo", "t_id|>b"]) == "ab"
    assert run(["a<|e", "o", "m_id|><|eot_id|>"]) == "a"
    assert run(["a<|eo", "x"]) == "a<|eox"
    assert run(["tail <|"]) == "tail <|"
    assert SpecialTextFilter([]).feed("<|eot_id|>") == "<|eot_id|>"


# --- the official client over a mock transport ------------------------------------------------


def client_for(parsers: OutputParsers, text: str) -> openai.OpenAI:
    def handler(request: Any) -> Any:
        parsed = parse_request(json.loads(request.content), "chat")
        r = OpenAIResponder(parsed, "m", str, lambda: parsers.new_output(parsed))
        if not parsed.stream:
            return httpx.Response(200, json=whole(r, deltas(text, 3)).model_dump())
        events = stream(r, deltas(text, 3))
        content = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=content.encode(),
                              headers={"content-type": "text/event-stream"})

    return openai.OpenAI(api_key="k", base_url="http://tandem.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def official_calls(calls: Iterator[Any]) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls]


def test_official_client_assembles_the_calls() -> None:
    client = client_for(HERMES, HERMES_TEXT)
    kwargs: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "tools": [WEATHER, TIME]}
    reply = client.chat.completions.create(**kwargs)
    expected = [("get_weather", PARIS), ("get_time", "{}")]
    assert official_calls(iter(reply.choices[0].message.tool_calls or [])) == expected
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas_seen = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas_seen] == [0, 0, 1, 1]
    assert deltas_seen[0].id and deltas_seen[0].type == "function"
    # The client's own accumulation of a stream gives the same message.
    with client.chat.completions.stream(**kwargs) as events:
        final = events.get_final_completion()
    assert official_calls(iter(final.choices[0].message.tool_calls or [])) == expected
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.content == "Let me check."
