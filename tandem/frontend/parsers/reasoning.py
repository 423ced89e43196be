"""Reasoning parsers: split a reasoning model's output into `reasoning_content` and `content`.

Each format implements ReasoningStream; `parse` runs the same stream over the whole text, so
streaming and non-streaming agree by construction. Streams hold back any suffix that may be the
start of a tag, so `<thi` + `nk>` is recognised and no tag text reaches either side.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from tandem.frontend.parsers.types import ReasoningDelta, ReasoningParse


class ReasoningStream(ABC):
    """Splits one output, fed as text deltas, into reasoning and content deltas."""

    def __init__(self) -> None:
        self._finished = False

    @property
    @abstractmethod
    def found_reasoning(self) -> bool:
        """Whether the output has a reasoning part (reasoning_content is then not None)."""

    def feed(self, delta: str) -> ReasoningDelta:
        """Adds a text delta; returns what it decides on each side (possibly nothing)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._advance(delta, eof=False)

    def finish(self) -> ReasoningDelta:
        """Ends the output: releases everything held back."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return self._advance("", eof=True)

    @abstractmethod
    def _advance(self, delta: str, eof: bool) -> ReasoningDelta:
        """Adds `delta` and returns what is decided; at `eof` everything is decided."""


def collect_reasoning(deltas: Iterable[ReasoningDelta], found_reasoning: bool) -> ReasoningParse:
    """Folds streamed deltas into the non-streaming result."""
    parts = list(deltas)
    reasoning = "".join(d.reasoning for d in parts)
    return ReasoningParse(reasoning if found_reasoning else None,
                          "".join(d.content for d in parts))


class ReasoningParser:
    """A reasoning format picked by name: `parse` for whole outputs, `stream` for deltas."""

    def __init__(self, name: str, new_stream: Callable[[], ReasoningStream],
                 markers: tuple[str, ...] = ()) -> None:
        self.name = name
        self._new_stream = new_stream
        #: The tags this format reads (special tokens in some families: the text must then be
        #: decoded with special tokens kept).
        self.markers = markers

    def stream(self) -> ReasoningStream:
        """A fresh per-request streaming splitter."""
        return self._new_stream()

    def parse(self, text: str) -> ReasoningParse:
        """Splits a whole output into (reasoning_content or None, content)."""
        stream = self.stream()
        deltas = [stream.feed(text), stream.finish()]
        return collect_reasoning(deltas, stream.found_reasoning)
