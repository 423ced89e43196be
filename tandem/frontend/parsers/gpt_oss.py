"""`gpt_oss`: reasoning in gpt-oss's harmony format (see harmony_text.py).

Messages on the `analysis` channel are the chain of thought: their bodies become reasoning.
Messages for the user (`final`, and `commentary` preambles) have their bodies passed on as
content, headers and end tokens removed. Messages addressed to a recipient (`to=functions.NAME`:
tool calls) are passed on verbatim, markup included, so that the `harmony` tool parser run after
this one can read them; a request without tools produces none. Text outside any message is
content, so output without harmony markup passes through unchanged.
"""
from __future__ import annotations

import enum

from tandem.frontend.parsers._text import find_first, held_suffix, leading_marker
from tandem.frontend.parsers.harmony_text import END_TOKENS, HEADER_OPENERS, read_header
from tandem.frontend.parsers.reasoning import ReasoningStream
from tandem.frontend.parsers.types import ReasoningDelta

_MARKERS = (*HEADER_OPENERS, *END_TOKENS)


class _Mode(enum.Enum):
    OUTSIDE = "outside"      # between messages, or text without harmony markup
    REASONING = "reasoning"  # body of an analysis message
    CONTENT = "content"      # body of a message for the user
    VERBATIM = "verbatim"    # a message to a recipient, passed on with its markup


class HarmonyReasoningStream(ReasoningStream):
    """The harmony splitter: analysis bodies to reasoning, the rest to content."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode = _Mode.OUTSIDE
        self._found = False

    @property
    def found_reasoning(self) -> bool:
        return self._found

    def _advance(self, delta: str, eof: bool) -> ReasoningDelta:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            step = self._step(eof)
            if step is None:
                break
            text, consumed, is_reasoning = step
            (reasoning if is_reasoning else content).append(text)
            self._buf = self._buf[consumed:]
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _step(self, eof: bool) -> tuple[str, int, bool] | None:
        """Decides the front of the buffer: (text, consumed, whether it is reasoning), or None."""
        buf = self._buf
        token = leading_marker(buf, END_TOKENS)
        if token is not None:
            verbatim = self._mode is _Mode.VERBATIM
            self._mode = _Mode.OUTSIDE
            return (token if verbatim else ""), len(token), False
        if buf.startswith(HEADER_OPENERS):
            header = read_header(buf, eof)
            if header is None:
                return None
            if header is not False:  # else not a header after all: the opener is plain text
                head, end = header
                if head.recipient:
                    self._mode = _Mode.VERBATIM
                    return buf[:end], end, False
                self._mode = _Mode.REASONING if head.channel == "analysis" else _Mode.CONTENT
                self._found = self._found or self._mode is _Mode.REASONING
                return "", end, False
        hit = find_first(buf, _MARKERS, 1)
        n = hit[0] if hit else len(buf) - (0 if eof else held_suffix(buf, _MARKERS))
        return (buf[:n], n, self._mode is _Mode.REASONING) if n else None
