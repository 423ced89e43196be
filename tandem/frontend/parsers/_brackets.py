"""Where a bracketed JSON (or Python literal) value ends, in text that arrives in pieces."""
from __future__ import annotations

import re

_OPENERS = "[{("
_CLOSERS = {"}": "{", "]": "[", ")": "("}
_JSON_SPECIALS = re.compile(r'["\[\]{}]')
_PY_SPECIALS = re.compile(r'["\'\[\](){}]')
# A string's body up to its closing quote, skipping escapes (stops before a trailing backslash).
_STRING_BODY = {q: re.compile(rf"[^{q}\\]*(?:\\.[^{q}\\]*)*", re.DOTALL) for q in "\"'"}


class BracketError(ValueError):
    """The brackets do not match; `end` is the index just past the offending character."""

    def __init__(self, end: int) -> None:
        super().__init__(f"mismatched bracket before index {end}")
        self.end = end


class BracketScanner:
    """Finds the end of the bracketed value opening at `text[start]`, resuming across calls.

    Brackets inside string literals are ignored; `python` also knows single-quoted strings and
    parentheses. Between calls the text may only grow at its end (a held region receiving
    deltas), so each call scans only what is new: a long held tool call costs linear time, not
    a rescan per delta.
    """

    def __init__(self, start: int, python: bool = False) -> None:
        self._pos = start
        self._specials = _PY_SPECIALS if python else _JSON_SPECIALS
        self._stack: list[str] = []
        self._quote: str | None = None
        self._end: int | None = None

    def end(self, text: str) -> int | None:
        """Index just past the value, or None while it is incomplete.

        Raises BracketError where a closing bracket does not match.
        """
        if self._end is not None:
            return self._end
        pos = self._pos
        while True:
            if self._quote is not None:
                body = _STRING_BODY[self._quote].match(text, pos)
                pos = body.end() if body else pos
                if pos >= len(text) or text[pos] != self._quote:
                    self._pos = pos  # still inside the string
                    return None
                pos += 1
                self._quote = None
                continue
            m = self._specials.search(text, pos)
            if m is None:
                self._pos = len(text)
                return None
            char, pos = m.group(), m.end()
            if char in "\"'":
                self._quote = char
                continue
            if char in _OPENERS:
                self._stack.append(char)
            elif not self._stack or self._stack.pop() != _CLOSERS[char]:
                raise BracketError(pos)
            if not self._stack:
                self._end = pos
                return pos


def bracket_end(text: str, start: int, python: bool = False) -> int | None:
    """One-shot BracketScanner: where the value opening at `text[start]` ends, or None."""
    return BracketScanner(start, python).end(text)
