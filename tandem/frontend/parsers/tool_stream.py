"""The streaming driver shared by all tool-call formats, and the non-streaming parse built on it.

Semantics, the same for every format:

- Text outside markup is content. Text that may still turn out to be markup (a marker prefix at
  the end of a chunk, a call region not closed yet) is held back until it is decided, so markup
  never leaks into content whatever the chunking.
- A call is emitted once its region is complete and valid: one ToolCallStart (index, id, name),
  then its arguments as a single ToolCallArguments fragment. Arguments are not streamed piece by
  piece because a call can only be validated whole: a region found malformed at its end (bad
  JSON, truncated by max_tokens, wrong shape) falls back to content with its raw text, which
  would be impossible after fragments went out. NVIDIA Dynamo's frontend "jails" calls the same
  way. The event shape allows finer fragments later without changing callers.
- Malformed regions are never dropped: the opening marker becomes content and scanning resumes
  right after it (or, where the format knows the region's end, the whole region becomes content),
  so the client receives the raw text.
- Whitespace touching markup is dropped (see _text.TrimmedText); other text is passed unchanged.

`parse(text)` runs the same machine over the whole text, so streaming and non-streaming agree by
construction, and the formats' contract (tool_format.py) makes the result independent of how
the text was split into deltas.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tandem.frontend.parsers._text import TrimmedText, find_first, held_suffix, leading_marker
from tandem.frontend.parsers.tool_format import (
    FALLBACK,
    Position,
    RawCall,
    RegionMemo,
    ToolFormat,
)
from tandem.frontend.parsers.types import (
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParse,
)


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCallStream:
    """Splits one output, fed as text deltas, into content and tool-call events."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self._fmt = fmt
        self._new_id = new_id
        self._buf = ""
        self._pos = Position.START
        self._content = TrimmedText()
        self._memo = RegionMemo()
        self._num_calls = 0
        self._finished = False

    @property
    def num_calls(self) -> int:
        """Calls emitted so far (the finish reason is `tool_calls` when this is non-zero)."""
        return self._num_calls

    def feed(self, delta: str) -> list[StreamEvent]:
        """Adds a text delta; returns the events it decides (possibly none)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._drain(eof=False)

    def finish(self) -> list[StreamEvent]:
        """Ends the output: decides everything held back and returns the last events."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        events = self._drain(eof=True)
        tail = self._content.flush()
        if tail:
            events.append(ContentDelta(tail))
        return events

    def _drain(self, eof: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._buf:
            step = self._step(eof)
            if step is None:
                break
            pieces, consumed = step
            self._buf = self._buf[consumed:]
            self._memo.clear()
            if not pieces:
                self._content.markup()
            for piece in pieces:
                self._emit(piece, events)
        return events

    def _step(self, eof: bool) -> tuple[list[RawCall | str], int] | None:
        """Decides the front of the buffer: (pieces, characters consumed), or None to wait."""
        buf, fmt, pos = self._buf, self._fmt, self._pos
        if pos is Position.AFTER_CALL and buf[0] in fmt.separators:
            return [], 1
        if fmt.implicit_start and pos is not Position.TEXT and buf[0].isspace():
            n = len(buf) - len(buf.lstrip())
            return [buf[:n]], n
        opens = fmt.opens_region(buf, pos, eof)
        if opens is None and not eof:
            return None
        if opens:
            region = fmt.read_region(buf, pos, eof, self._memo)
            if region is None and not eof:
                return None
            if region is None or region is FALLBACK:
                n = len(leading_marker(buf, fmt.markers) or buf[0])
                return [buf[:n]], n
            return list(region.pieces), region.consumed
        hit = find_first(buf, fmt.markers, 1)
        n = hit[0] if hit else len(buf) - (0 if eof else held_suffix(buf, fmt.markers))
        return ([buf[:n]], n) if n else None

    def _emit(self, piece: RawCall | str, events: list[StreamEvent]) -> None:
        if isinstance(piece, RawCall):
            self._content.markup()
            index = self._num_calls
            self._num_calls += 1
            events.append(ToolCallStart(index, self._new_id(), piece.name))
            events.append(ToolCallArguments(index, piece.arguments))
            self._pos = Position.AFTER_CALL
            return
        text = self._content.push(piece)
        if text:
            events.append(ContentDelta(text))
            self._pos = Position.TEXT


def collect(events: Iterable[StreamEvent]) -> ToolParse:
    """Folds streaming events into the non-streaming result (what a client would assemble)."""
    content: list[str] = []
    starts: dict[int, ToolCallStart] = {}
    args: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            starts[event.index] = event
            args[event.index] = []
        else:
            args[event.index].append(event.fragment)
    calls = [ToolCall(starts[i].id, starts[i].name, "".join(args[i])) for i in sorted(starts)]
    return ToolParse("".join(content), calls)


class ToolParser:
    """A tool-call format picked by name: `parse` for whole outputs, `stream` for deltas."""

    def __init__(self, name: str, fmt: ToolFormat) -> None:
        self.name = name
        self._fmt = fmt

    @property
    def markers(self) -> tuple[str, ...]:
        """Every markup string this format reads (special tokens in some families: the text
        must then be decoded with special tokens kept)."""
        return (*self._fmt.markers, *self._fmt.inner_markup)

    def stream(self) -> ToolCallStream:
        """A fresh per-request streaming splitter."""
        return ToolCallStream(self._fmt)

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any]],
                       json_whitespace: int) -> str | None:
        """The format's grammar for a forced call (ToolFormat.forced_grammar); None: bare JSON."""
        return self._fmt.forced_grammar(functions, json_whitespace)

    def parse(self, text: str) -> ToolParse:
        """Splits a whole output into content and tool calls."""
        stream = self.stream()
        return collect([*stream.feed(text), *stream.finish()])
