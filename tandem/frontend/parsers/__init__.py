"""Output parsers: tool calls and reasoning, split out of a model's generated text.

Library only: each parser works on decoded text, whole (`parse`) or as a stream of deltas
(`stream().feed(delta)` ... `finish()`), and is picked by its vLLM / Dynamo name:

    parser = tool_parser("hermes")
    result = parser.parse(text)                # ToolParse(content, calls)
    stream = parser.stream()                   # one per request
    events = stream.feed(delta)                # ContentDelta / ToolCallStart / ToolCallArguments

Markers of several families (Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`, harmony's
`<|channel|>`) are special tokens: the text given to these parsers must be decoded with special
tokens kept. For gpt-oss run the `gpt_oss` reasoning parser first and the `harmony` tool parser
on its content.
"""
from __future__ import annotations

from tandem.frontend.parsers.reasoning import ReasoningParser, ReasoningStream
from tandem.frontend.parsers.registry import (
    REASONING_PARSER_NAMES,
    TOOL_PARSER_NAMES,
    reasoning_parser,
    tool_parser,
)
from tandem.frontend.parsers.tool_stream import ToolCallStream, ToolParser, collect
from tandem.frontend.parsers.types import (
    ContentDelta,
    ReasoningDelta,
    ReasoningParse,
    StreamEvent,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParse,
)

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_PARSER_NAMES",
    "ContentDelta",
    "ReasoningDelta",
    "ReasoningParse",
    "ReasoningParser",
    "ReasoningStream",
    "StreamEvent",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolCallStream",
    "ToolParse",
    "ToolParser",
    "collect",
    "reasoning_parser",
    "tool_parser",
]
