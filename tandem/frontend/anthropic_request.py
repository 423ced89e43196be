"""Anthropic Messages request bodies (POST /v1/messages, /v1/messages/count_tokens), translated
into the equivalent Chat Completions body and parsed by tandem.frontend.openai_request, so that
both APIs share one validation, tokenization and generation path.

Field by field (the messages themselves: tandem.frontend.anthropic_content):
  - model, stream -> the same; max_tokens (required, >= 1) -> max_tokens;
  - stop_sequences -> stop; temperature (0..1), top_p, top_k -> the same;
  - tools [{name, description, input_schema}] -> function tools; tool_choice auto / any /
    tool {name} / none -> "auto" / "required" / the named function / "none";
    disable_parallel_tool_use -> parallel_tool_calls false;
  - thinking {type: enabled, budget_tokens} -> the template variable enable_thinking true
    (disabled: false; adaptive: the template's default). The deployment's --reasoning-parser
    splits the reasoning off into `thinking` blocks whatever the request says; without one,
    `thinking` enabled is a 400 (the reasoning could not be told from the answer). The budget
    is checked (>= 1, below max_tokens) but only max_tokens bounds the output;
  - output_config.format {type: json_schema, schema} -> response_format json_schema;
    output_config.effort -> reasoning_effort (for templates that read it);
  - metadata, cache_control, service_tier -> accepted and ignored (nothing is stored, prefix
    caching is automatic, there is one service tier);
  - REFUSED fields (server-side tools, containers, ...) -> a 400 naming them unless null;
    any other field -> a 400 too.
Errors raised on the chat body name the Anthropic field (`ParamMap`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidRequest
from tandem.frontend.anthropic_content import ParamMap, chat_messages
from tandem.frontend.json_fields import get_bool, get_float, get_int, get_object, json_type, must
from tandem.frontend.openai_request import ParsedRequest, parse_request

HONOURED = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
                      "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
                      "output_config"})
#: Accepted and ignored, with the reason.
IGNORED: dict[str, str] = {
    "metadata": "a user id for abuse monitoring; nothing is stored or logged",
    "cache_control": "prefix caching is automatic: KV blocks are matched by token content",
    "service_tier": "there is one service tier",
}
#: Fields of the API that Tandem does not honour: a 400 unless null (or the value given here).
REFUSED: dict[str, object] = {
    "container": None, "mcp_servers": None, "context_management": None, "inference_geo": None,
    "diagnostics": None, "user_profile_id": None, "workspace_id": None, "speed": "standard",
}
_TOOL_KEYS = frozenset({"name", "description", "input_schema", "type", "cache_control",
                        "strict"})
_THINKING_TYPES = ("enabled", "disabled", "adaptive")
#: Chat paths that are renamed rather than nested (checked after the message paths).
_RENAMED = {"stop": "stop_sequences", "tool_choice.function.name": "tool_choice.name",
            "tool_choice.function": "tool_choice", "parallel_tool_calls":
            "tool_choice.disable_parallel_tool_use", "response_format.json_schema.schema":
            "output_config.format.schema", "response_format": "output_config.format",
            "reasoning_effort": "output_config.effort", "chat_template_kwargs": "thinking",
            "max_completion_tokens": "max_tokens"}


@dataclass(frozen=True)
class MessagesRequest:
    """A translated Messages request: the chat body and how to name its fields back."""

    chat_body: dict[str, Any]
    params: ParamMap = field(compare=False)
    #: The `thinking` type asked for; None: absent.
    thinking: str | None = None

    @property
    def stream(self) -> bool:
        return bool(self.chat_body.get("stream"))

    @property
    def model(self) -> object:
        return self.chat_body.get("model")

    def parse(self, headers: Mapping[str, str]) -> ParsedRequest:
        """The chat body parsed; its errors name the Anthropic fields."""
        with self.anthropic_names():
            return parse_request(self.chat_body, "chat", headers)

    def anthropic_names(self) -> _Renaming:
        """A context in which an InvalidRequest's param and message get the Anthropic names."""
        return _Renaming(self.params)


class _Renaming:
    def __init__(self, params: ParamMap) -> None:
        self.params = params

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, InvalidRequest) and exc.param:
            old, new = exc.param, self.params.to_anthropic(exc.param)
            exc.param = new
            exc.message = exc.message.replace(old, new)
            exc.args = (exc.message,)


def translate(body: object, *, count_only: bool = False) -> MessagesRequest:
    """The chat body of Anthropic body `body`. With `count_only` (count_tokens), max_tokens is
    optional.

    Raises:
        InvalidRequest: naming the Anthropic field at fault.
    """
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {json_type(body)}")
    _check_fields(body)
    model = body.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", param="model")
    if not isinstance(model, str) or not model:
        raise must("model", "a non-empty string", model)
    params = ParamMap()
    for chat_path, anthropic_path in _RENAMED.items():
        params.add(chat_path, anthropic_path)
    chat: dict[str, Any] = {"model": model,
                            "messages": chat_messages(body.get("system"), body.get("messages"),
                                                      params)}
    max_tokens = get_int(body, "max_tokens", lo=1)
    if max_tokens is None and not count_only:
        raise InvalidRequest("'max_tokens' is required", param="max_tokens")
    chat["max_tokens"] = max_tokens
    chat["stream"] = get_bool(body, "stream")
    chat["temperature"] = get_float(body, "temperature", lo=0.0, hi=1.0)
    chat["top_p"] = get_float(body, "top_p", lo=0.0, hi=1.0, lo_open=True)
    chat["top_k"] = get_int(body, "top_k", lo=0)
    chat["stop"] = _stop_sequences(body.get("stop_sequences"))
    tools = _tools(body.get("tools"), params)
    if tools:
        chat["tools"] = tools
        chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(body.get("tool_choice"))
    elif (body.get("tool_choice") is not None
          and _choice_object(body["tool_choice"]).get("type") != "none"):
        raise InvalidRequest("'tool_choice' needs a non-empty 'tools'", param="tool_choice")
    thinking = _thinking(body.get("thinking"), max_tokens)
    if thinking in ("enabled", "disabled"):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking == "enabled"}
    _output_config(get_object(body, "output_config"), chat)
    return MessagesRequest({k: v for k, v in chat.items() if v is not None}, params, thinking)


def _check_fields(body: dict[str, Any]) -> None:
    for name, allowed in REFUSED.items():
        value = body.get(name)
        if value is not None and value != allowed:
            raise InvalidRequest(f"'{name}' is not supported by this server", param=name)
    unknown = sorted(k for k in body if k not in HONOURED and k not in IGNORED
                     and k not in REFUSED)
    if unknown:
        raise InvalidRequest(f"'{unknown[0]}' is not a field of the Messages API",
                             param=unknown[0])
    get_object(body, "metadata")


def _stop_sequences(value: object) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise must("stop_sequences", "an array of strings", value)
    return value or None


def _tools(value: object, params: ParamMap) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise must("tools", "an array of tools", value)
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise must(where, "an object", tool)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise InvalidRequest(f"'{where}.type' {kind!r} is a server tool, which is not "
                                 "supported (only client tools: name, description, "
                                 "input_schema)", param=f"{where}.type")
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra and any(tool[k] not in (None, False) for k in extra):
            raise InvalidRequest(f"'{where}.{extra[0]}' is not supported",
                                 param=f"{where}.{extra[0]}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise must(f"{where}.input_schema", "a JSON schema object", schema)
        function = {k: tool[k] for k in ("name", "description") if k in tool}
        function["parameters"] = schema
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        params.add(f"tools[{i}].function.parameters", f"{where}.input_schema")
        params.add(f"tools[{i}].function", where)
        params.add(f"tools[{i}]", where)
        tools.append({"type": "function", "function": function})
    return tools


def _choice_object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise must("tool_choice", "an object with 'type'", value)
    return value


def _tool_choice(value: object) -> tuple[object, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if value is None:
        return "auto", None
    value = _choice_object(value)
    kind = value.get("type")
    allowed = {"type", "name"} if kind == "tool" else {"type"}
    if kind != "none":
        allowed.add("disable_parallel_tool_use")
    extra = sorted(set(value) - allowed)
    if extra:
        raise InvalidRequest(f"'tool_choice.{extra[0]}' is not a field of tool_choice "
                             f"{kind!r}", param=f"tool_choice.{extra[0]}")
    disable = get_bool(value, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")
    parallel = None if disable is None else not disable
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise must("tool_choice.name", "a non-empty string", name)
        return {"type": "function", "function": {"name": name}}, parallel
    raise InvalidRequest(f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}",
                         param="tool_choice.type")


def _thinking(value: object, max_tokens: int | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise must("thinking", "an object with 'type'", value)
    kind = value.get("type")
    if kind not in _THINKING_TYPES:
        raise InvalidRequest(f"'thinking.type' must be one of {', '.join(_THINKING_TYPES)}, "
                             f"got {kind!r}", param="thinking.type")
    allowed = {"type", "budget_tokens", "display"} if kind == "enabled" else {"type", "display"}
    extra = sorted(set(value) - allowed)
    if extra:
        raise InvalidRequest(f"'thinking.{extra[0]}' is not a field of thinking {kind!r}",
                             param=f"thinking.{extra[0]}")
    if value.get("display") not in (None, "summarized"):
        raise InvalidRequest("'thinking.display' may only be 'summarized': thinking is "
                             "returned as generated", param="thinking.display")
    if kind == "enabled":
        budget = get_int(value, "budget_tokens", "thinking.budget_tokens", lo=1)
        if budget is None:
            raise InvalidRequest("'thinking.budget_tokens' is required",
                                 param="thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequest(f"'thinking.budget_tokens' ({budget}) must be less than "
                                 f"'max_tokens' ({max_tokens})", param="thinking.budget_tokens")
    return str(kind)


def _output_config(config: dict[str, Any], chat: dict[str, Any]) -> None:
    extra = sorted(set(config) - {"format", "effort"})
    if extra:
        raise InvalidRequest(f"'output_config.{extra[0]}' is not supported",
                             param=f"output_config.{extra[0]}")
    fmt = get_object(config, "format", "output_config.format")
    if fmt:
        if fmt.get("type") != "json_schema" or set(fmt) - {"type", "schema"}:
            raise InvalidRequest("'output_config.format' must be {'type': 'json_schema', "
                                 "'schema': {...}}", param="output_config.format")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise must("output_config.format.schema", "a JSON schema object", schema)
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": schema,
                                                   "strict": True}}
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]


def check_deployment(request: MessagesRequest, parsed: ParsedRequest,
                     has_reasoning_parser: bool, has_tool_parser: bool) -> None:
    """Refuses what the serving deployment cannot do as asked, in Anthropic's terms.

    Raises:
        InvalidRequest: thinking enabled without --reasoning-parser; tool_choice auto (the
            default with tools) without --tool-call-parser.
    """
    if request.thinking == "enabled" and not has_reasoning_parser:
        raise InvalidRequest("this deployment has no reasoning parser (--reasoning-parser), so "
                             "it cannot return thinking blocks: drop 'thinking'",
                             param="thinking")
    if parsed.tools is not None and parsed.tools.choice == "auto" and not has_tool_parser:
        raise InvalidRequest("this deployment has no tool-call parser (--tool-call-parser), so "
                             "it cannot honour tool_choice 'auto' (the default with tools): "
                             "send tool_choice {'type': 'any'}, {'type': 'tool', 'name': ...} "
                             "(enforced with a JSON grammar) or {'type': 'none'}",
                             param="tool_choice")
