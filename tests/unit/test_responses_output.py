"""Response objects and stream events from deltas: the documented event order, sequence numbers,
items that assemble to the non-streamed answer, and the official client's models parse them."""
from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import AsyncIterator
from typing import Any

from openai.types.responses import Response, ResponseStreamEvent

from tandem.engines.types import FinishReason, Usage
from tandem.frontend.chat_output import ChatOutput
from tandem.frontend.output_parsers import OutputParsers
from tandem.frontend.pipeline import Delta
from tandem.frontend.responses_output import ResponseBuilder
from tandem.frontend.responses_request import ResponsesRequest, parse_chat, parse_responses
from tandem.frontend.responses_shapes import sse

#: event type -> the client's model of that event.
EVENTS = {cls.model_fields["type"].annotation.__args__[0]: cls  # type: ignore[union-attr]
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
TOOL = {"type": "function", "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def request(**body: Any) -> ResponsesRequest:
    return parse_responses({"model": "m", "input": "q", **body}, lambda _id: [])


def deltas(texts: list[str], reason: FinishReason = FinishReason.STOP) -> list[Delta]:
    out = [Delta(t, [], []) for t in texts]
    out[-1].finish_reason, out[-1].usage = reason, Usage(7, len(texts), 2)
    return out


def stream(builder: ResponseBuilder, items: list[Delta]) -> list[dict[str, Any]]:
    events = builder.first_events()
    for delta in items:
        events += builder.delta_events(delta)
    for event in events:
        EVENTS[event["type"]].model_validate(event)  # the client's own models accept it
    return events


def collect(builder: ResponseBuilder, items: list[Delta]) -> dict[str, Any]:
    async def gen() -> AsyncIterator[Delta]:
        for delta in items:
            yield delta
    return asyncio.run(builder.collect(gen()))


def reasoning_output(req: ResponsesRequest) -> ChatOutput:
    return OutputParsers.build("", "deepseek_r1", frozenset()).new_output(parse_chat(req))


def test_message_stream_follows_the_documented_order() -> None:
    events = stream(ResponseBuilder(request(), "m", ChatOutput()), deltas(["Hel", "lo", ""]))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    Response.model_validate(final)
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2,
                                                               "cache_write_tokens": 0},
                              "output_tokens": 3, "output_tokens_details": {
                                  "reasoning_tokens": 0}, "total_tokens": 10}
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {final["output"][0]["id"]} and final["id"].startswith("resp_")


def test_stream_and_collect_give_the_same_items() -> None:
    items = deltas(["<think>hm", "m</think>", "an", "swer"])
    req = request()
    streamed = stream(ResponseBuilder(req, "m", reasoning_output(req)), items)[-1]["response"]
    collected = collect(ResponseBuilder(req, "m", reasoning_output(req)), deltas(
        ["<think>hm", "m</think>", "an", "swer"]))
    strip = [{k: v for k, v in item.items() if k != "id"} for item in streamed["output"]]
    assert strip == [{k: v for k, v in item.items() if k != "id"}
                     for item in collected["output"]]
    assert [i["type"] for i in strip] == ["reasoning", "message"]
    assert strip[0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert strip[1]["content"][0]["text"] == "answer"


def test_reasoning_events_come_in_order() -> None:
    req = request()
    events = stream(ResponseBuilder(req, "m", reasoning_output(req)),
                    deltas(["<think>a", "b</think>c"]))
    kinds = [e["type"] for e in events]
    assert kinds[2:9] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0, 1]


def test_forced_tool_choice_gives_function_call_items() -> None:
    req = request(tools=[TOOL], tool_choice="required")
    output = OutputParsers().new_output(parse_chat(req))
    events = stream(ResponseBuilder(req, "m", output),
                    deltas(['[{"name": "f", ', '"arguments": {"x": 1}}]']))
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    call = events[-1]["response"]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "f"
    assert call["call_id"].startswith("call_") and json.loads(call["arguments"]) == {"x": 1}
    assert events[4]["arguments"] == call["arguments"]


def test_length_cut_is_incomplete() -> None:
    events = stream(ResponseBuilder(request(max_output_tokens=2), "m", ChatOutput()),
                    deltas(["a", "b"], FinishReason.LENGTH))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert final["response"]["max_output_tokens"] == 2


def test_failed_stream_ends_with_response_failed() -> None:
    builder = ResponseBuilder(request(), "m", ChatOutput())
    events = builder.first_events() + builder.delta_events(Delta("a", [], []))
    events += builder.failed_events("server_error", "worker died")
    EVENTS[events[-1]["type"]].model_validate(events[-1])
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "worker died"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_echoes_settings_and_sse_framing() -> None:
    req = request(metadata={"a": "b"}, temperature=0.0, tools=[TOOL], tool_choice="none")
    body = collect(ResponseBuilder(req, "m", ChatOutput()), deltas(["x"]))
    Response.model_validate(body)
    assert body["metadata"] == {"a": "b"} and body["temperature"] == 0.0
    assert body["tools"] == [TOOL] and body["tool_choice"] == "none" and body["store"] is True
    frame = sse({"type": "response.created", "sequence_number": 0})
    assert frame.startswith(b"event: response.created\ndata: {") and frame.endswith(b"\n\n")
