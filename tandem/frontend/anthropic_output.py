"""Turns the pipeline's deltas into Anthropic Messages answers: the message object of a
non-streamed answer, the server-sent events of a streamed one. Both come from one block builder,
so a stream assembles to exactly the message a non-streamed request gets.

The answer's text goes through its ChatOutput (tandem.frontend.chat_output): reasoning becomes
`thinking` blocks (signature "": there is nothing to verify), content `text` blocks, tool calls
`tool_use` blocks whose `input` is the call's parsed arguments. A block is opened when output of
another kind arrives, so blocks follow the order the model wrote them.

Stream, in Anthropic's documented order: message_start; per block content_block_start,
content_block_delta (text_delta, thinking_delta, input_json_delta)*, content_block_stop;
message_delta (stop_reason, stop_sequence, usage); message_stop. An answer with no output still
gets one empty text block, streamed or not.

stop_reason: "max_tokens" when cut by max_tokens or the context; "tool_use" when it called
tools; "stop_sequence" (with `stop_sequence`) when one of the request's stop_sequences ended it;
else "end_turn".
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.engines.types import FinishReason, Usage
from tandem.frontend.chat_output import ChatOutput, OutputDelta
from tandem.frontend.parsers import ToolCallStart
from tandem.frontend.pipeline import Delta

JsonDict = dict[str, Any]
#: (SSE event name, its data).
Event = tuple[str, JsonDict]
BlockKind = Literal["text", "thinking", "tool_use"]
_DELTA_TYPES: dict[BlockKind, tuple[str, str]] = {
    "text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
    "tool_use": ("input_json_delta", "partial_json")}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for a call id of the tool parsers ("call_..." -> "toolu_...")."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(reason: FinishReason, made_calls: bool, stop_sequence: str | None) -> str:
    if reason is FinishReason.LENGTH:
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


@dataclass
class _Block:
    kind: BlockKind
    index: int
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""

    def start_body(self) -> JsonDict:
        """The block as content_block_start announces it: empty."""
        if self.kind == "text":
            return {"type": "text", "text": ""}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        return {"type": "tool_use", "id": self.call_id, "name": self.name, "input": {}}

    def body(self) -> JsonDict:
        """The finished block, as the message object holds it."""
        text = "".join(self.parts)
        if self.kind == "text":
            return {"type": "text", "text": text}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}
        try:
            arguments = json.loads(text) if text.strip() else {}
        except ValueError:
            arguments = None
        # A parser's arguments are a JSON object; anything else has no `input` to give.
        return {"type": "tool_use", "id": self.call_id, "name": self.name,
                "input": arguments if isinstance(arguments, dict) else {}}


class AnthropicResponder:
    """Builds the answer of one request. `output` splits the answer's text
    (Frontend.chat_output); `input_tokens` is the prompt's length, known before any token."""

    def __init__(self, model: str, input_tokens: int, output: ChatOutput) -> None:
        self.id = new_message_id()
        self.model = model
        self.input_tokens = input_tokens
        self._output = output
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block] = {}
        self._finish: tuple[FinishReason, str | None] | None = None
        self.usage: Usage | None = None

    # --- events ---------------------------------------------------------------------------

    def start_events(self) -> list[Event]:
        """message_start: the message with no content and no stop_reason yet."""
        message = {**self._envelope(), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": self._usage_body(0)}
        return [("message_start", {"type": "message_start", "message": message})]

    def delta_events(self, delta: Delta) -> list[Event]:
        """The events one delta adds (the closing ones after the last delta)."""
        events = self._take(self._output.feed(delta.text))
        if delta.finish_reason is not None:
            events += self._take(self._output.finish())
            events += self._finish_events(delta.finish_reason, delta)
        return events

    def _take(self, out: OutputDelta) -> list[Event]:
        events: list[Event] = []
        if out.reasoning:
            events += self._append("thinking", out.reasoning)
        if out.content:
            events += self._append("text", out.content)
        for event in out.calls:
            if isinstance(event, ToolCallStart):
                opened, block = self._open_block("tool_use", call_id=tool_use_id(event.id),
                                                 name=event.name)
                events += opened
                self._calls[event.index] = block
            elif event.fragment:
                block = self._calls[event.index]
                if block is not self._open:  # parsers send a call's fragments in order
                    raise RuntimeError(f"arguments of tool call {event.index} after its block")
                events.append(self._delta_event(block, event.fragment))
        return events

    def _append(self, kind: BlockKind, text: str) -> list[Event]:
        block = self._open
        events: list[Event] = []
        if block is None or block.kind != kind:
            events, block = self._open_block(kind)
        return [*events, self._delta_event(block, text)]

    def _open_block(self, kind: BlockKind, call_id: str = "",
                    name: str = "") -> tuple[list[Event], _Block]:
        events = self._close_block()
        block = _Block(kind, len(self._blocks), call_id=call_id, name=name)
        self._blocks.append(block)
        self._open = block
        events.append(("content_block_start", {"type": "content_block_start",
                                               "index": block.index,
                                               "content_block": block.start_body()}))
        return events, block

    def _close_block(self) -> list[Event]:
        if self._open is None:
            return []
        index, self._open = self._open.index, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _delta_event(self, block: _Block, text: str) -> Event:
        block.parts.append(text)
        kind, key = _DELTA_TYPES[block.kind]
        return ("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                        "delta": {"type": kind, key: text}})

    def _finish_events(self, finish: FinishReason, delta: Delta) -> list[Event]:
        events = [] if self._blocks else self._open_block("text")[0]
        events += self._close_block()
        # The stop string that ended the answer, where the pipeline reports it.
        matched = delta.stop_string
        self._finish = (finish, matched)
        self.usage = delta.usage
        reason = stop_reason(finish, bool(self._calls), matched)
        usage = self._usage_body(self._output_tokens())
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason,
                                                   "stop_sequence": matched},
                                         "usage": usage}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    # --- the non-streamed message -----------------------------------------------------------

    async def collect(self, deltas: AsyncIterator[Delta]) -> JsonDict:
        """The whole message of a non-streamed answer."""
        async for delta in deltas:
            self.delta_events(delta)
        return self.message()

    def message(self) -> JsonDict:
        """The message object, once the last delta went through `delta_events`."""
        reason, matched = self._finish or (FinishReason.STOP, None)
        return {**self._envelope(), "content": [b.body() for b in self._blocks],
                "stop_reason": stop_reason(reason, bool(self._calls), matched),
                "stop_sequence": matched, "usage": self._usage_body(self._output_tokens())}

    def _envelope(self) -> JsonDict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _output_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else 0

    def _usage_body(self, output_tokens: int) -> JsonDict:
        return {"input_tokens": self.input_tokens, "output_tokens": output_tokens}
