"""`harmony`: gpt-oss tool calls, harmony messages addressed to `functions.NAME`.

See harmony_text.py for the format. A message whose recipient is `to=functions.NAME` (on the
`commentary` channel, usually with `<|constrain|>json`) is a call; its body is the arguments
object, and it ends with `<|call|>`. Every other message is text for the user: its header and
end token are markup and its body streams as content, whatever the channel. That includes
`analysis` (chain of thought) when this parser sees it: run the `gpt_oss` reasoning parser first
to move it to `reasoning_content`; that one passes messages to a recipient on verbatim, markup
included, for this one to read.
Messages to other recipients (the built-in `browser.*` and `python` tools) are content too: they
are not function calls in the OpenAI sense.
A forced tool_choice is enforced as one such call message, not as bare JSON (harmony_grammar.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tandem.frontend.parsers._json import dump_arguments, loads_object
from tandem.frontend.parsers._text import find_first
from tandem.frontend.parsers.harmony_grammar import forced_call_ebnf
from tandem.frontend.parsers.harmony_text import (
    ALL_MARKERS,
    END_TOKENS,
    HEADER_OPENERS,
    read_header,
)
from tandem.frontend.parsers.tool_format import (
    FALLBACK,
    Fallback,
    Position,
    RawCall,
    Region,
    RegionMemo,
    ToolFormat,
)


class HarmonyFormat(ToolFormat):
    markers: ClassVar[tuple[str, ...]] = ALL_MARKERS

    def opens_region(self, buf: str, pos: Position, eof: bool) -> bool | None:
        return buf.startswith(HEADER_OPENERS) or buf.startswith(END_TOKENS)

    def read_region(self, buf: str, pos: Position, eof: bool,
                    memo: RegionMemo) -> Region | Fallback | None:
        for token in END_TOKENS:
            if buf.startswith(token):
                return Region(len(token))
        header = read_header(buf, eof)
        if header is None:
            return None
        if header is False:
            return FALLBACK
        head, body_start = header
        name = head.function
        if name is None:
            return Region(body_start)  # header is markup; the body streams as content
        hit = find_first(buf, (*END_TOKENS, *HEADER_OPENERS), body_start)
        if hit is None and not eof:
            return None
        end, token = hit if hit else (len(buf), "")
        args = loads_object(buf[body_start:end])
        consumed = end + len(token) if token in END_TOKENS else end
        if args is None:  # the whole message, raw, becomes content
            return Region(consumed, (buf[:consumed],))
        return Region(consumed, (RawCall(name, dump_arguments(args)),))

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any]],
                       json_whitespace: int) -> str | None:
        return forced_call_ebnf(functions, json_whitespace)
