"""Parsers by name, with the names vLLM and NVIDIA Dynamo use for the same formats.

`--tool-call-parser` names: hermes, llama3_json, mistral, pythonic, deepseek_v3, harmony.
`--reasoning-parser` names: deepseek_r1, qwen3, gpt_oss.
"""
from __future__ import annotations

from collections.abc import Callable

from tandem.frontend.parsers.deepseek_v3 import DeepSeekV3Format
from tandem.frontend.parsers.gpt_oss import HarmonyReasoningStream
from tandem.frontend.parsers.harmony import HarmonyFormat
from tandem.frontend.parsers.harmony_text import ALL_MARKERS
from tandem.frontend.parsers.hermes import HermesFormat
from tandem.frontend.parsers.llama3_json import Llama3JsonFormat
from tandem.frontend.parsers.mistral import MistralFormat
from tandem.frontend.parsers.pythonic import PythonicFormat
from tandem.frontend.parsers.reasoning import ReasoningParser, ReasoningStream
from tandem.frontend.parsers.think import CLOSE, OPEN, ThinkStream
from tandem.frontend.parsers.tool_format import ToolFormat
from tandem.frontend.parsers.tool_stream import ToolParser

_TOOL_FORMATS: dict[str, Callable[[], ToolFormat]] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": MistralFormat,
    "pythonic": PythonicFormat,
    "deepseek_v3": DeepSeekV3Format,
    "harmony": HarmonyFormat,
}

_REASONING_STREAMS: dict[str, Callable[[], ReasoningStream]] = {
    "deepseek_r1": lambda: ThinkStream(implicit_open=True),
    "qwen3": lambda: ThinkStream(implicit_open=False),
    "gpt_oss": HarmonyReasoningStream,
}

_REASONING_MARKERS: dict[str, tuple[str, ...]] = {
    "deepseek_r1": (OPEN, CLOSE), "qwen3": (OPEN, CLOSE), "gpt_oss": ALL_MARKERS}

TOOL_PARSER_NAMES: tuple[str, ...] = tuple(_TOOL_FORMATS)
REASONING_PARSER_NAMES: tuple[str, ...] = tuple(_REASONING_STREAMS)


def tool_parser(name: str) -> ToolParser:
    """The tool-call parser called `name`; ValueError listing the valid names otherwise."""
    factory = _TOOL_FORMATS.get(name)
    if factory is None:
        raise ValueError(f"unknown tool call parser {name!r}; "
                         f"valid names: {', '.join(TOOL_PARSER_NAMES)}")
    return ToolParser(name, factory())


def reasoning_parser(name: str) -> ReasoningParser:
    """The reasoning parser called `name`; ValueError listing the valid names otherwise."""
    factory = _REASONING_STREAMS.get(name)
    if factory is None:
        raise ValueError(f"unknown reasoning parser {name!r}; "
                         f"valid names: {', '.join(REASONING_PARSER_NAMES)}")
    return ReasoningParser(name, factory, _REASONING_MARKERS[name])
