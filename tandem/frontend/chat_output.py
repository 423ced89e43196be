"""What one chat answer's text becomes: reasoning, content and tool calls.

The detokenizer's text deltas pass, in order, through
  1. the special-token filter (tandem.frontend.special_text), when special tokens were kept for
     the parsers but the client did not ask for them;
  2. the reasoning stream (--reasoning-parser): reasoning apart, content on. Not for an output
     under a constraint (response_format, guided_*, a forced tool_choice as JSON): the grammar
     holds from the first token, so there is no reasoning part to split off;
  3. on the content, either the tool-call stream (tool_choice "auto" with --tool-call-parser),
     or, for a forced tool_choice (required or named), the collector that turns the whole JSON
     output into calls once it is complete (see tandem.frontend.tool_request). A forced choice
     enforced in the tool parser's own markup (harmony) takes stages 2 and 3 as "auto" does
     (tandem.frontend.output_parsers).
Text held back by a stage (a possible marker, an open call region) comes out at `finish`,
which must be called once, after the last delta, before the answer's final event.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.frontend.parsers import (
    ContentDelta,
    ReasoningStream,
    StreamEvent,
    ToolCallArguments,
    ToolCallStart,
    ToolCallStream,
)
from tandem.frontend.parsers.tool_stream import new_call_id
from tandem.frontend.special_text import SpecialTextFilter
from tandem.frontend.tool_request import ToolRequest

CallEvent = ToolCallStart | ToolCallArguments


@dataclass
class OutputDelta:
    """What a text delta (or the end of the output) adds on each side; any part may be empty."""

    reasoning: str = ""
    content: str = ""
    #: In order: a call's ToolCallStart, then its ToolCallArguments fragments.
    calls: list[CallEvent] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, other: OutputDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)


class ChatOutput:
    """Splits one chat answer, fed as text deltas. With no stage configured it passes text
    through as content (`is_plain`)."""

    def __init__(self, *, special_texts: tuple[str, ...] = (),
                 reasoning: ReasoningStream | None = None, tools: ToolCallStream | None = None,
                 forced: ToolRequest | None = None, max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._special = SpecialTextFilter(special_texts) if special_texts else None
        self._reasoning = reasoning
        self._tools = tools
        self._forced = forced
        self._forced_text: list[str] = []
        self._max_calls = max_calls
        self._new_id = new_id
        self._num_calls = 0

    @property
    def is_plain(self) -> bool:
        """Whether text passes unchanged (no filter, no parser)."""
        return (self._special is None and self._reasoning is None and self._tools is None
                and self._forced is None)

    @property
    def num_calls(self) -> int:
        """Tool calls emitted so far (the finish reason is "tool_calls" when non-zero)."""
        return self._num_calls

    @property
    def found_reasoning(self) -> bool:
        """Whether the answer has a reasoning part (reasoning_content is then not None)."""
        return self._reasoning is not None and self._reasoning.found_reasoning

    def feed(self, text: str) -> OutputDelta:
        """Adds a text delta; returns what it decides."""
        if self._special is not None:
            text = self._special.feed(text)
        return self._split(text, eof=False)

    def finish(self) -> OutputDelta:
        """Ends the answer: everything held back, and a forced choice's calls."""
        text = self._special.finish() if self._special is not None else ""
        return self._split(text, eof=True)

    def _split(self, text: str, eof: bool) -> OutputDelta:
        out = OutputDelta()
        if self._reasoning is not None:
            parts = self._reasoning.feed(text) if text else None
            end = self._reasoning.finish() if eof else None
            out.reasoning = (parts.reasoning if parts else "") + (end.reasoning if end else "")
            text = (parts.content if parts else "") + (end.content if end else "")
        if self._forced is not None:
            self._forced_text.append(text)
            if eof:
                self._forced_calls(self._forced, out)
            return out
        if self._tools is None:
            out.content = text
            return out
        events = self._tools.feed(text) if text else []
        if eof:
            events += self._tools.finish()
        self._take(events, out)
        return out

    def _take(self, events: list[StreamEvent], out: OutputDelta) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                out.content += event.text
            elif self._max_calls is None or event.index < self._max_calls:
                if isinstance(event, ToolCallStart):
                    self._num_calls += 1
                out.calls.append(event)

    def _forced_calls(self, forced: ToolRequest, out: OutputDelta) -> None:
        text = "".join(self._forced_text)
        calls = forced.calls_from_json(text)
        if calls is None:  # incomplete JSON (cut by max_tokens): the client gets it as text
            out.content += text
            return
        for name, arguments in calls:
            index = self._num_calls
            self._num_calls += 1
            out.calls += [ToolCallStart(index, self._new_id(), name),
                          ToolCallArguments(index, arguments)]
