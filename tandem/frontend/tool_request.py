"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request, as one ToolRequest.

tool_choice:
  - "none": the model answers in text; `tools` still reach the chat template (the model knows
    them, as with OpenAI) and nothing is parsed out of the output.
  - "auto" (the default when `tools` is non-empty): the model may call tools; its calls are
    parsed out of the text by the deployment's --tool-call-parser (a 400 without one).
  - "required", or {"type": "function", "function": {"name": ...}}: the model must call (that)
    tool. As vLLM does, this is enforced with guided decoding rather than parsed: the output is
    constrained to a JSON schema (named: {"name": <that name>, "arguments": <its parameters
    schema>}; required: an array, at least one item, of such objects for any tool) and the JSON
    becomes the calls directly, with no markup and no parser needed. Such a request cannot also
    carry a structured-output constraint (response_format, guided_*).
    Where the deployment's tool parser has a grammar of its own for a forced call
    (ToolFormat.forced_grammar: harmony, whose gpt-oss would be out of its format writing bare
    JSON), that grammar replaces the schema and the parser reads the calls
    (tandem.frontend.output_parsers).
parallel_tool_calls (default true): false allows at most one call: "required" gets maxItems 1
in its schema; "auto" keeps the first call parsed and drops any later one.

Tool `strict` flags are accepted: schemas are enforced (in xgrammar's strict mode) exactly when
the choice is required or named, and never under "auto".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.engines.guided.grammar import check
from tandem.engines.types import GuidedDecoding, GuidedKind
from tandem.errors import InvalidRequest
from tandem.frontend.json_fields import get_bool, must

ToolChoice = Literal["none", "auto", "required", "function"]
#: Request fields of this module: chat only.
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function the model may call."""

    name: str
    #: The tool as the chat template gets it: OpenAI's {"type": "function", "function": {...}}.
    spec: dict[str, Any] = field(compare=False)
    #: Its parameters' JSON schema (an empty object schema when the client gave none).
    parameters: dict[str, Any] = field(compare=False)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools of one chat request and how the model may use them."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    #: choice "function": the function the model must call.
    function: str | None = None
    #: False: at most one call.
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The `tools` argument of the chat template (transformers' apply_chat_template)."""
        return [tool.spec for tool in self.tools]

    @property
    def is_forced(self) -> bool:
        """Whether the calls come from a guided JSON output (required or named)."""
        return self.choice in ("required", "function")

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced choice constrains the output to; None otherwise."""
        if self.choice == "function":
            tool = next(t for t in self.tools if t.name == self.function)
            return _call_schema(tool)
        if self.choice != "required":
            return None
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"anyOf": [_call_schema(t) for t in self.tools]}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def forced_functions(self) -> dict[str, dict[str, Any]]:
        """Name -> parameters schema of each function a forced choice may call (the named one,
        or every tool for "required"), in the client's order; empty for none/auto."""
        if not self.is_forced:
            return {}
        return {t.name: t.parameters for t in self.tools
                if self.choice == "required" or t.name == self.function}

    def calls_from_json(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call in a forced choice's output; None when the text
        is not the complete JSON the schema asked for (an output cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        items = [value] if self.choice == "function" else value
        if not isinstance(items, list):
            return None
        calls = []
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("arguments"), dict)):
                return None
            calls.append((item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
        return calls


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.name]},
                           "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def parse_tools(body: dict[str, Any], guided: GuidedDecoding | None) -> ToolRequest | None:
    """The request's ToolRequest; None without tools (or with an empty `tools` array).

    `guided` is the request's own structured-output constraint: tools that may be called
    cannot be combined with one (the grammar would forbid every call).

    Raises:
        InvalidRequest: a malformed tool or tool_choice, an unknown function name, a forced
            choice without tools, or tools beside a structured-output constraint.
    """
    tools = _tools(body.get("tools"))
    choice, function = _tool_choice(body.get("tool_choice"), tools)
    parallel = get_bool(body, "parallel_tool_calls")
    if not tools:
        return None
    request = ToolRequest(tools, choice, function, True if parallel is None else parallel)
    if choice != "none" and guided is not None:
        raise InvalidRequest(
            f"tool_choice {_describe(request)} cannot be combined with a structured-output "
            "constraint (response_format, guided_*): the constrained output could not call a "
            "tool; send tool_choice 'none' or drop the constraint", param="tool_choice")
    schema = request.output_schema()
    if schema is not None:
        index = next((i for i, t in enumerate(tools) if t.name == function), None)
        check(GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(schema)),
              "tools" if index is None else f"tools[{index}].function.parameters")
    return request


def guided_for(request: ToolRequest | None) -> GuidedDecoding | None:
    """The constraint that enforces a forced choice; None for none/auto."""
    schema = None if request is None else request.output_schema()
    return None if schema is None else GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(schema))


def _describe(request: ToolRequest) -> str:
    return f"function {request.function!r}" if request.choice == "function" else repr(
        request.choice)


def _tools(value: object) -> tuple[FunctionTool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise must("tools", "an array of tools", value)
    tools: list[FunctionTool] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise must(where, "an object", tool)
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequest(f"'{where}.type' must be 'function' (custom tools are not "
                                 f"supported), got {kind!r}", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise must(f"{where}.function", "an object with 'name'", function)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise must(f"{where}.function.name", "a non-empty string", name)
        if any(t.name == name for t in tools):
            raise InvalidRequest(f"'{where}.function.name' {name!r} names a second tool",
                                 param=f"{where}.function.name")
        spec: dict[str, Any] = {"name": name}
        description = function.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise must(f"{where}.function.description", "a string", description)
            spec["description"] = description
        get_bool(function, "strict", f"{where}.function.strict")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise must(f"{where}.function.parameters", "a JSON schema object", parameters)
            spec["parameters"] = parameters
        tools.append(FunctionTool(name, {"type": "function", "function": spec},
                                  parameters if parameters is not None else _NO_PARAMETERS))
    return tuple(tools)


def _tool_choice(value: object, tools: tuple[FunctionTool, ...]
                 ) -> tuple[ToolChoice, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs a non-empty 'tools'",
                                 param="tool_choice")
        return value, None  # type: ignore[return-value]
    if isinstance(value, str):
        raise InvalidRequest(f"'tool_choice' must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {value!r}",
                             param="tool_choice")
    if not isinstance(value, dict):
        raise must("tool_choice", "a string or an object", value)
    kind = value.get("type")
    if kind != "function":
        raise InvalidRequest(f"'tool_choice.type' must be 'function' (allowed_tools and custom "
                             f"tools are not supported), got {kind!r}", param="tool_choice.type")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise must("tool_choice.function.name", "a non-empty string", name)
    if not any(t.name == name for t in tools):
        known = ", ".join(repr(t.name) for t in tools) or "none"
        raise InvalidRequest(f"'tool_choice.function.name' {name!r} is not one of the request's "
                             f"tools (tools: {known})", param="tool_choice.function.name")
    return "function", name
