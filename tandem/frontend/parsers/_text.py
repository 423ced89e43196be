"""Helpers shared by the parsers: marker search, marker hold-back, whitespace trimming.

Streaming parsers see text in arbitrary pieces, so a marker such as `<tool_call>` may arrive as
`<tool_` + `call>`. The rule everywhere: text is released only once no marker can still start
inside it, i.e. the longest suffix that is a proper prefix of some marker is held back.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

_SPACE = re.compile(r"\s*")


def match_end(pattern: re.Pattern[str], text: str, start: int) -> int:
    """Where a match of `pattern` at `start` ends (`start` if it does not match)."""
    m = pattern.match(text, start)
    return m.end() if m else start


def skip_space(text: str, start: int = 0) -> int:
    """Index of the first non-whitespace character at or after `start`, len(text) if none."""
    return match_end(_SPACE, text, start)


def find_first(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any marker at or after `start`, as (index, marker)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(marker) > len(best[1]))):
            best = (i, marker)
    return best


def leading_marker(text: str, markers: Iterable[str]) -> str | None:
    """The longest marker `text` starts with, if any."""
    found = [m for m in markers if text.startswith(m)]
    return max(found, key=len) if found else None


def held_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker.

    That suffix may still become a marker once more text arrives, so it must not be released.
    """
    held = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:k]):
                held = k
                break
    return held


class TrimmedText:
    """One output channel (content or reasoning) where whitespace touching markup is dropped.

    Models surround markup with newlines (`Let me check.\\n\\n<tool_call>`, `</think>\\n\\n`);
    those are layout, not text for the user. Whitespace is therefore held until the next
    non-whitespace text shows it is inside the text (then it is released) or the next markup
    shows it borders markup (then it is dropped). Text that never meets markup passes through
    unchanged, including leading and trailing whitespace.
    """

    def __init__(self, after_markup: bool = False) -> None:
        self._pending = ""
        self._after_markup = after_markup

    def push(self, text: str) -> str:
        """Adds text; returns what can be released now."""
        text = self._pending + text
        if self._after_markup:
            text = text.lstrip()
        body = text.rstrip()
        self._pending = text[len(body):]
        if body:
            self._after_markup = False
        return body

    def markup(self) -> None:
        """Markup was consumed at this point: whitespace on either side of it is dropped."""
        self._pending = ""
        self._after_markup = True

    def flush(self) -> str:
        """End of output: releases held whitespace that borders no markup."""
        text, self._pending = self._pending, ""
        return text
