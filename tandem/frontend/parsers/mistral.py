"""`mistral`: Mistral's `[TOOL_CALLS]` special token, in both of its tokenizer generations.

As mistral-common encodes assistant tool calls:

- tokenizers v2 to v7 (Mistral 7B Instruct v0.3, Mixtral 8x22B, Mistral Nemo, Large 2407):
  one `[TOOL_CALLS]` followed by a JSON list,
  `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]`;
- tokenizers v11 and later (Mistral Small 3.1+, Magistral, Devstral, Ministral 3): one
  `[TOOL_CALLS]` per call, then the name, an optional `[CALL_ID]id`, `[ARGS]` and the arguments
  object, `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}`.

Mistral's own 9-character call ids are not kept: ids come from the parser, as for every format.
The markers are special tokens, so the output must be decoded with special tokens kept.
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from tandem.frontend.parsers._brackets import BracketError
from tandem.frontend.parsers._json import call_from_object
from tandem.frontend.parsers._text import match_end, skip_space
from tandem.frontend.parsers.tool_format import (
    FALLBACK,
    Fallback,
    Position,
    RawCall,
    Region,
    RegionMemo,
    ToolFormat,
)

TOOL_CALLS = "[TOOL_CALLS]"
CALL_ID = "[CALL_ID]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[\w.\-]*")
_ID = re.compile(r"\w*")


class MistralFormat(ToolFormat):
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    inner_markup: ClassVar[tuple[str, ...]] = (CALL_ID, ARGS)

    def read_region(self, buf: str, pos: Position, eof: bool,
                    memo: RegionMemo) -> Region | Fallback | None:
        start = skip_space(buf, len(TOOL_CALLS))
        if start == len(buf):
            return None
        if buf[start] == "[" and not buf.startswith(ARGS, start):
            return _read_list(buf, start, memo)
        return _read_named(buf, start, memo)


def _read_list(buf: str, start: int, memo: RegionMemo) -> Region | Fallback | None:
    """The v2-v7 form: a JSON list of {"name", "arguments"} objects."""
    try:
        end = memo.bracket_end(buf, start)
    except BracketError:
        return FALLBACK
    if end is None:
        return None
    try:
        items: Any = json.loads(buf[start:end])
    except ValueError:
        return FALLBACK
    if not isinstance(items, list) or not items:
        return FALLBACK
    calls = [call_from_object(item, ("arguments",)) for item in items]
    if any(call is None for call in calls):
        return FALLBACK
    return Region(end, tuple(RawCall(*call) for call in calls if call is not None))


def _read_named(buf: str, start: int, memo: RegionMemo) -> Region | Fallback | None:
    """The v11+ form: `name[CALL_ID]id[ARGS]{...}`, the call id being optional."""
    name_end = match_end(_NAME, buf, start)
    i = name_end
    if buf.startswith(CALL_ID, i):
        i = match_end(_ID, buf, i + len(CALL_ID))
    elif _is_cut(buf, i, CALL_ID):
        return None
    if _is_cut(buf, i, ARGS):
        return None
    if not buf.startswith(ARGS, i) or name_end == start:
        return FALLBACK
    args_start = skip_space(buf, i + len(ARGS))
    if args_start == len(buf):
        return None
    if buf[args_start] != "{":
        return FALLBACK
    try:
        end = memo.bracket_end(buf, args_start)
    except BracketError:
        return FALLBACK
    if end is None:
        return None
    obj = {"name": buf[start:name_end], "arguments": buf[args_start:end]}
    call = call_from_object(obj, ("arguments",))
    return FALLBACK if call is None else Region(end, (RawCall(*call),))


def _is_cut(buf: str, i: int, token: str) -> bool:
    """Whether the buffer ends inside (or right before) `token` starting at `i`."""
    return len(buf) - i < len(token) and token.startswith(buf[i:])
