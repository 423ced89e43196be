"""`hermes`: calls wrapped in `<tool_call>` tags, each holding one JSON object.

The format of NousResearch's Hermes 2 Pro / Hermes 3 models, adopted by Qwen2.5 and Qwen3,
whose chat templates instruct: "For each function call, return a json object with function name
and arguments within <tool_call></tool_call> XML tags":

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}
    </tool_call>

The tags are ordinary added tokens (not special), so they survive `skip_special_tokens`. A last
call whose closing tag is missing at the end of the output (generation stopped right after the
JSON, or the next call began) is still accepted if its JSON is complete.
"""
from __future__ import annotations

from typing import ClassVar

from tandem.frontend.parsers._json import call_from_object, loads_object
from tandem.frontend.parsers._text import find_first
from tandem.frontend.parsers.tool_format import (
    FALLBACK,
    Fallback,
    Position,
    RawCall,
    Region,
    RegionMemo,
    ToolFormat,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesFormat(ToolFormat):
    markers: ClassVar[tuple[str, ...]] = (OPEN,)

    def read_region(self, buf: str, pos: Position, eof: bool,
                    memo: RegionMemo) -> Region | Fallback | None:
        hit = find_first(buf, (CLOSE, OPEN), len(OPEN))
        if hit is None and not eof:
            return None
        end, tag = hit if hit else (len(buf), "")
        call = call_from_object(loads_object(buf[len(OPEN):end]), ("arguments", "parameters"))
        if call is None:
            return FALLBACK
        # A next <tool_call> before any closing tag closes this one too (and is not consumed).
        consumed = end + len(CLOSE) if tag == CLOSE else end
        return Region(consumed, (RawCall(*call),))
