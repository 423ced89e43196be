"""Anthropic message objects and stream events from deltas: the documented event order, blocks
of each kind (thinking, text, tool_use with parsed input), stop reasons, and a stream that
assembles (with the official client's own accumulator) to the non-streamed message."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tandem.engines.types import FinishReason, Usage
from tandem.frontend.anthropic_output import AnthropicResponder, Event
from tandem.frontend.chat_output import ChatOutput
from tandem.frontend.parsers.registry import reasoning_parser, tool_parser
from tandem.frontend.pipeline import Delta

EVENT = TypeAdapter(RawMessageStreamEvent)


def deltas(texts: list[str], reason: FinishReason = FinishReason.STOP) -> list[Delta]:
    out = [Delta(t, [1], []) for t in texts]
    out[-1].finish_reason = reason
    out[-1].usage = Usage(7, len(texts))
    return out


def hermes_output() -> ChatOutput:
    return ChatOutput(reasoning=reasoning_parser("deepseek_r1").stream(),
                      tools=tool_parser("hermes").stream())


def stream(make: Callable[[], ChatOutput], texts: list[str],
           reason: FinishReason = FinishReason.STOP) -> list[Event]:
    responder = AnthropicResponder("m", 7, make())
    events = responder.start_events()
    for delta in deltas(texts, reason):
        events += responder.delta_events(delta)
    return events


def collect(make: Callable[[], ChatOutput], texts: list[str],
            reason: FinishReason = FinishReason.STOP) -> dict[str, Any]:
    async def gen() -> AsyncIterator[Delta]:
        for delta in deltas(texts, reason):
            yield delta
    return asyncio.run(AnthropicResponder("m", 7, make()).collect(gen()))


def assert_documented_order(names: list[str]) -> None:
    names = [n for n in names if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    body = names[1:-2]
    assert body, "at least one block"
    i = 0
    while i < len(body):
        assert body[i] == "content_block_start"
        i += 1
        while body[i] == "content_block_delta":
            i += 1
        assert body[i] == "content_block_stop"
        i += 1


def assembled(events: list[Event]) -> Message:
    """The message the official client's stream accumulator builds from `events`."""
    message: Any = None
    buffers: dict[int, bytes] = {}
    for name, data in events:
        assert data["type"] == name
        message = accumulate_event(event=EVENT.validate_python(data), current_snapshot=message,
                                   json_bufs=buffers)
    assert message is not None
    return message


TOOL_TEXT = ["<think>plan", " it</think>", "Sure. ", "<tool_call>\n",
             '{"name": "weather", "arguments": {"city": ', '"Oslo"}}\n</tool_call>']


def test_text_answer() -> None:
    events = stream(ChatOutput, ["Hel", "lo"])
    assert_documented_order([n for n, _ in events])
    message = collect(ChatOutput, ["Hel", "lo"])
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["role"] == "assistant" and message["model"] == "m"
    assert message["content"] == [{"type": "text", "text": "Hello"}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 2}
    Message.model_validate(message)
    assert assembled(events).content[0].text == "Hello"  # type: ignore[union-attr]
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == 7 and start["stop_reason"] is None


def test_thinking_text_and_tool_use_blocks() -> None:
    events = stream(hermes_output, TOOL_TEXT)
    assert_documented_order([n for n, _ in events])
    message = collect(hermes_output, TOOL_TEXT)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["thinking"] == "plan it"
    call = message["content"][2]
    assert call["name"] == "weather" and call["input"] == {"city": "Oslo"}
    assert call["id"].startswith("toolu_")
    assert message["stop_reason"] == "tool_use"
    Message.model_validate(message)
    streamed = assembled(events).model_dump(exclude_none=True)
    for block in streamed["content"] + message["content"]:
        block.pop("id", None)  # each responder makes its own call ids
    assert streamed["content"] == message["content"]
    assert streamed["stop_reason"] == "tool_use"
    deltas_of_call = [d["delta"] for n, d in events if n == "content_block_delta"
                      and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(d["partial_json"] for d in deltas_of_call)) == {"city": "Oslo"}


def test_empty_answer_has_one_empty_text_block() -> None:
    events = stream(ChatOutput, [""])
    assert [n for n, _ in events] == ["message_start", "content_block_start",
                                      "content_block_stop", "message_delta", "message_stop"]
    assert collect(ChatOutput, [""])["content"] == [{"type": "text", "text": ""}]


@pytest.mark.parametrize(("reason", "expected"), [(FinishReason.LENGTH, "max_tokens"),
                                                  (FinishReason.STOP, "end_turn"),
                                                  (FinishReason.CANCELLED, "end_turn")])
def test_stop_reasons(reason: FinishReason, expected: str) -> None:
    events = stream(ChatOutput, ["a"], reason)
    final = [d for n, d in events if n == "message_delta"][0]
    assert final["delta"]["stop_reason"] == expected
    assert final["usage"]["output_tokens"] == 1
    assert collect(ChatOutput, ["a"], reason)["stop_reason"] == expected


def test_a_call_cut_by_max_tokens_is_max_tokens() -> None:
    message = collect(hermes_output, TOOL_TEXT, FinishReason.LENGTH)
    assert message["stop_reason"] == "max_tokens"


def test_client_parses_every_event() -> None:
    for name, data in stream(hermes_output, TOOL_TEXT):
        assert EVENT.validate_python(data).type == name
    assert anthropic.types.MessageTokensCount(input_tokens=3).input_tokens == 3


def test_a_matched_stop_sequence_is_named() -> None:
    # The pipeline reports which stop string ended the answer (Delta.stop_string).
    answer = deltas(["Hel", "lo"])
    answer[-1].stop_string = "END"

    async def gen() -> AsyncIterator[Delta]:
        for delta in answer:
            yield delta
    message = asyncio.run(AnthropicResponder("m", 7, ChatOutput()).collect(gen()))
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    responder = AnthropicResponder("m", 7, ChatOutput())
    events = responder.start_events()
    for delta in answer:
        events += responder.delta_events(delta)
    final = next(body for name, body in events if name == "message_delta")
    assert final["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
