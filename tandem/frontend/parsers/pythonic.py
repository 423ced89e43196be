"""`pythonic`: calls written as a Python list of function calls (Llama 3.2, Llama 4).

Meta's Llama 3.2 prompt format for zero-shot function calling asks for
`[func_name1(param_name1=value1, param_name2=value2), func_name2(...)]` and nothing else;
Llama 4 may wrap the list in `<|python_start|>` ... `<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]

The list is parsed with Python's `ast` and only literals are accepted as values (strings,
numbers, booleans, None, and lists / tuples / dicts of them; JSON's `true`, `false` and `null`
too, which models sometimes write), so nothing is ever evaluated. Arguments must be keywords.
Without the Llama 4 marker, a `[` opens a call list only at the start of the output and only if
it is followed by `identifier(`; `[1, 2]` or `[Note]` is content.
"""
from __future__ import annotations

import ast
import re
from typing import Any, ClassVar

from tandem.frontend.parsers._brackets import BracketError
from tandem.frontend.parsers._json import dump_arguments
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

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_][\w.]*")
_NAMED_CONSTANTS = {"True": True, "False": False, "None": None,
                    "true": True, "false": False, "null": None}


class PythonicFormat(ToolFormat):
    markers: ClassVar[tuple[str, ...]] = (PYTHON_START, PYTHON_END)
    implicit_start: ClassVar[bool] = True

    def opens_region(self, buf: str, pos: Position, eof: bool) -> bool | None:
        if buf.startswith(self.markers):
            return True
        if pos is not Position.START or buf[0] != "[":
            return False
        name_start = skip_space(buf, 1)
        name_end = match_end(_IDENT, buf, name_start)
        if name_end == len(buf):
            return None if not eof else False
        return name_end > name_start and buf[name_end] == "("

    def read_region(self, buf: str, pos: Position, eof: bool,
                    memo: RegionMemo) -> Region | Fallback | None:
        if buf.startswith(PYTHON_END):
            return Region(len(PYTHON_END))
        start = skip_space(buf, len(PYTHON_START)) if buf.startswith(PYTHON_START) else 0
        if start == len(buf):
            return None
        if buf[start] != "[":
            return FALLBACK
        try:
            end = memo.bracket_end(buf, start, python=True)
        except BracketError:
            return FALLBACK
        if end is None:
            return None
        calls = parse_call_list(buf[start:end])
        return FALLBACK if calls is None else Region(end, tuple(calls))


def parse_call_list(source: str) -> list[RawCall] | None:
    """`[f(a=1), g.h(b="x")]` as calls with JSON arguments, or None if it is anything else."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls: list[RawCall] = []
    for node in tree.elts:
        name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
        if name is None or not isinstance(node, ast.Call) or node.args:
            return None
        args: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                args[keyword.arg] = _literal(keyword.value)
            except ValueError:
                return None
        try:
            calls.append(RawCall(name, dump_arguments(args)))
        except (TypeError, ValueError):  # not representable in JSON (e.g. nan is, bytes are not)
            return None
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    """The value of a literal node; ValueError for anything that is not a plain literal."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(elt) for elt in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return {k: _literal(v) for k, v in zip(keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)}")
