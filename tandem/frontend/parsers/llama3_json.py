"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 JSON tool calls.

Meta's prompt format for custom tools asks the model to answer a call with a bare JSON object
`{"name": function name, "parameters": dictionary of argument name and its value}`, optionally
after the `<|python_tag|>` special token (emitted with `Environment: ipython`), generation then
ending with `<|eom_id|>` or `<|eot_id|>`. Several calls come one after another, separated by `;`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A call has no marker of its own, so a `{` opens one only at the start of the output or right
after another call, and only if its first key is "name" (or "type", which some Llama 3.2/3.3
outputs put first: `{"type": "function", "name": ..., "parameters": ...}`). A JSON answer with
other keys is content. "arguments" is accepted in place of "parameters". What follows
`<|python_tag|>` other than JSON (the built-in tools' `brave_search.call(...)`) is content.
"""
from __future__ import annotations

import json
from typing import ClassVar

from tandem.frontend.parsers._brackets import BracketError
from tandem.frontend.parsers._json import call_from_object
from tandem.frontend.parsers._text import skip_space
from tandem.frontend.parsers.tool_format import (
    FALLBACK,
    Fallback,
    Position,
    RawCall,
    Region,
    RegionMemo,
    ToolFormat,
)

PYTHON_TAG = "<|python_tag|>"
_FIRST_KEYS = ('"name"', '"type"')


class Llama3JsonFormat(ToolFormat):
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)
    implicit_start: ClassVar[bool] = True
    separators: ClassVar[str] = ";"

    def opens_region(self, buf: str, pos: Position, eof: bool) -> bool | None:
        if buf.startswith(PYTHON_TAG):
            return True
        if pos is Position.TEXT or buf[0] != "{":
            return False
        rest = buf[skip_space(buf, 1):]
        if any(rest.startswith(key) for key in _FIRST_KEYS):
            return True
        undecided = any(key.startswith(rest) for key in _FIRST_KEYS)
        return None if undecided and not eof else False

    def read_region(self, buf: str, pos: Position, eof: bool,
                    memo: RegionMemo) -> Region | Fallback | None:
        start = skip_space(buf, len(PYTHON_TAG)) if buf.startswith(PYTHON_TAG) else 0
        if start == len(buf):
            return None
        if buf[start] != "{":
            return FALLBACK
        try:
            end = memo.bracket_end(buf, start)
        except BracketError:
            return FALLBACK
        if end is None:
            return None
        try:
            obj = json.loads(buf[start:end])
        except ValueError:
            return FALLBACK
        call = call_from_object(obj, ("parameters", "arguments"))
        return FALLBACK if call is None else Region(end, (RawCall(*call),))
