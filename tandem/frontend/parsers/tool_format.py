"""The interface each tool-call format implements, and what it hands back to the stream driver.

A format sees the undecided text at the front of the stream (`buf`) and answers one question at
a time: does a tool-call region open here, and if so, how far does it go and what does it hold?
The driver (tool_stream.py) owns everything else: content, hold-back, ids, events.

Contract for every format, which makes streaming independent of how the text was split: each
answer depends only on a prefix of `buf` that ends where the answer was decided, never on where
`buf` happens to end. "Not decided yet" is answered with None; at `eof` the driver takes an
undecided opening as no region and an undecided region as malformed.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tandem.frontend.parsers._brackets import BracketScanner


class Position(enum.Enum):
    """Where the front of `buf` sits in the output, for formats whose calls have no marker."""

    START = "start"            # nothing but whitespace before it
    AFTER_CALL = "after_call"  # nothing but whitespace and separators since the last call
    TEXT = "text"              # after user-visible text


@dataclass(frozen=True)
class RawCall:
    """A parsed call before the driver gives it an id: name and JSON arguments string."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Region:
    """A decided stretch of markup: `consumed` characters of `buf` yielding `pieces`.

    `pieces` holds calls and content strings in output order; empty means pure markup (a
    block delimiter, a separator, a message header) that yields nothing.
    """

    consumed: int
    pieces: tuple[RawCall | str, ...] = ()


class Fallback(enum.Enum):
    FALLBACK = "fallback"


#: What read_region returns when the region is malformed: its opening marker becomes content.
FALLBACK = Fallback.FALLBACK


class RegionMemo:
    """Scratch space for the region being read, kept across deltas while it is held.

    The driver clears it whenever it consumes text, so between clears `buf` only grows at its
    end and a format can resume a scan instead of rescanning the whole held region per delta.
    """

    def __init__(self) -> None:
        self._scanners: dict[tuple[int, bool], BracketScanner] = {}

    def bracket_end(self, buf: str, start: int, python: bool = False) -> int | None:
        """BracketScanner.end for the value opening at `buf[start]`, resumed from last time."""
        key = (start, python)
        scanner = self._scanners.get(key)
        if scanner is None:
            scanner = self._scanners[key] = BracketScanner(start, python)
        return scanner.end(buf)

    def clear(self) -> None:
        self._scanners.clear()


class ToolFormat(ABC):
    """One model family's tool-call markup."""

    #: Strings that open a region wherever they appear (special tokens of the family).
    markers: ClassVar[tuple[str, ...]] = ()
    #: Markup read inside a region besides the markers (Mistral's `[ARGS]`): with the markers,
    #: every string the text must keep when special tokens are otherwise removed.
    inner_markup: ClassVar[tuple[str, ...]] = ()
    #: Whether a region may also open without a marker at START/AFTER_CALL (JSON, Python list);
    #: the driver then releases leading whitespace separately so the region sees its first char.
    implicit_start: ClassVar[bool] = False
    #: Characters consumed silently right after a call (Llama's `;` between JSON calls).
    separators: ClassVar[str] = ""

    def opens_region(self, buf: str, pos: Position, eof: bool) -> bool | None:
        """Whether a region opens at `buf[0]`; None while undecided. Default: a marker."""
        return any(buf.startswith(m) for m in self.markers)

    @abstractmethod
    def read_region(self, buf: str, pos: Position, eof: bool,
                    memo: RegionMemo) -> Region | Fallback | None:
        """Reads the region opening at `buf[0]`; `memo` carries scans over from earlier calls.

        Returns the Region once its end is known; FALLBACK if it is malformed (the driver then
        emits the opening marker as content and scans on after it, so the raw text survives);
        None if more text is needed.
        """

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any]],
                       json_whitespace: int) -> str | None:
        """How a forced tool_choice (required, or a named function) is enforced in this format.

        Args:
            functions: name -> parameters JSON schema of the functions the output may call.
            json_whitespace: most whitespace characters between two tokens of the arguments'
                JSON (0: compact), as --json-whitespace.
        Returns:
            An EBNF grammar (as xgrammar reads it) whose language is a call in this format's
            markup, which `read_region` then reads like any other; None (the default): the call
            is enforced as bare JSON instead (tandem.frontend.tool_request), for formats whose
            models write JSON calls anyway.
        Raises:
            GrammarError: a parameters schema the grammar cannot hold.
        """
        return None
