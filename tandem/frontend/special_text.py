"""Removal of special-token text from a stream of text deltas.

When the output parsers need special tokens that `skip_special_tokens` would drop (Llama's
`<|python_tag|>`, Mistral's `[TOOL_CALLS]`, harmony's `<|channel|>`), the frontend decodes with
special tokens kept and removes every other special token's text here, before the parsers, so
that the client sees what skip_special_tokens would have shown it (an end-of-turn token such as
`<|eot_id|>` included) and the parsers see their markers and nothing else.
"""
from __future__ import annotations

import re
from collections.abc import Iterable


class SpecialTextFilter:
    """Drops the given strings wherever they occur in a stream; one instance per request.

    A suffix of a delta that may be the start of one of them is held back until the next delta
    decides it, so a string split across deltas is removed too.
    """

    def __init__(self, texts: Iterable[str]) -> None:
        ordered = sorted({t for t in texts if t}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._prefixes = frozenset(t[:k] for t in ordered for k in range(1, len(t)))
        self._longest = len(ordered[0]) if ordered else 0
        self._held = ""

    def feed(self, text: str) -> str:
        """Adds a delta; returns the text that is decided, special strings removed."""
        if self._pattern is None:
            return text
        text = self._pattern.sub("", self._held + text)
        keep = self._held_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> str:
        """End of the stream: what was held back (no special string after all)."""
        text, self._held = self._held, ""
        return text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a special string."""
        for start in range(max(len(text) - self._longest + 1, 0), len(text)):
            if text[start:] in self._prefixes:
                return len(text) - start
        return 0
