"""`deepseek_v3`: DeepSeek-V3 / R1 tool calls between DeepSeek's tool-call tokens.

The DeepSeek-V3 and R1 chat templates write an assistant's calls as a block of calls, each with
its type, name and a fenced JSON body (the block and calls on one line, here broken for reading):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {"tz": "Europe/Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1 drops the type and the fence, `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
{"city": "Paris"}<｜tool▁call▁end｜>`; both forms are read. (The bars are U+FF5C FULLWIDTH
VERTICAL LINE and the word separators U+2581 LOWER ONE EIGHTH BLOCK, as in the tokenizer.)
The block is one region: its calls are emitted when `<｜tool▁calls▁end｜>` arrives (the model
stops right after it), and a block with any malformed call is content, raw, as a whole.
"""
from __future__ import annotations

import re
from typing import ClassVar

from tandem.frontend.parsers._json import call_from_object, loads_object
from tandem.frontend.parsers.tool_format import (
    FALLBACK,
    Fallback,
    Position,
    RawCall,
    Region,
    RegionMemo,
    ToolFormat,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_V3_CALL = re.compile(
    r"\s*(?P<type>\w+)" + re.escape(SEP) + r"(?P<name>[^\n]+?)\s*\n"
    r"```(?:json)?\s*\n(?P<args>.*?)\s*```\s*", re.DOTALL)
_V31_CALL = re.compile(r"\s*(?P<name>[^\n]+?)" + re.escape(SEP) + r"(?P<args>.*)", re.DOTALL)
_CALL = re.compile(r"\s*" + re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), re.DOTALL)


class DeepSeekV3Format(ToolFormat):
    markers: ClassVar[tuple[str, ...]] = (CALLS_BEGIN,)
    inner_markup: ClassVar[tuple[str, ...]] = (CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def read_region(self, buf: str, pos: Position, eof: bool,
                    memo: RegionMemo) -> Region | Fallback | None:
        close = buf.find(CALLS_END, len(CALLS_BEGIN))
        if close < 0 and not eof:
            return None
        end = close if close >= 0 else len(buf)
        calls: list[RawCall] = []
        i = len(CALLS_BEGIN)
        while (m := _CALL.match(buf, i, end)) is not None:
            call = parse_call(m.group(1))
            if call is None:
                return FALLBACK
            calls.append(call)
            i = m.end()
        if not calls or buf[i:end].strip():
            return FALLBACK
        return Region(close + len(CALLS_END) if close >= 0 else end, tuple(calls))


def parse_call(body: str) -> RawCall | None:
    """One call's body, in the V3/R1 (typed, fenced) or the V3.1 (bare) form."""
    m = _V3_CALL.fullmatch(body)
    if m is None or m.group("type") != "function":
        m = _V31_CALL.fullmatch(body)
    if m is None:
        return None
    call = call_from_object({"name": m.group("name").strip(),
                             "arguments": loads_object(m.group("args"))}, ("arguments",))
    return None if call is None else RawCall(*call)
