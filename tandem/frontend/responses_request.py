"""POST /v1/responses bodies, validated and translated into the equivalent Chat Completions body.

The Responses API is served as a thin adapter over the chat pipeline: `parse_responses` checks
the Responses-only fields and builds a chat body that tandem.frontend.openai_request then
validates as any chat request. Translation:
  - `input` (a string: one user message; or items) -> `messages`: message items (roles user,
    system, developer, assistant; content a string or input_text / output_text / input_image
    parts), `function_call` items -> an assistant message's tool_calls, `function_call_output`
    -> tool messages; `reasoning` items are dropped from the prompt;
  - `instructions` -> a leading system message (not carried over by previous_response_id);
  - `previous_response_id` -> the stored response's input and output items before `input`;
  - `tools` (function tools) / `tool_choice` / `parallel_tool_calls` -> their chat forms;
  - `text.format` -> response_format; `reasoning.effort` -> reasoning_effort;
    `max_output_tokens` -> max_tokens; temperature and top_p unchanged.
Errors the chat parser raises name chat fields; `ResponsesRequest.chat_error` maps their
`param` (and the quoted name in the message) back to the Responses field it came from.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidRequest, TandemError
from tandem.frontend.json_fields import get_bool, get_object, get_str, json_type, must
from tandem.frontend.openai_request import ParsedRequest, parse_request

JsonDict = dict[str, Any]
#: Looks up a stored response's conversation (its input items then its output items).
History = Callable[[str], list[JsonDict]]

HONOURED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "reasoning", "max_output_tokens", "temperature", "top_p", "metadata", "stream", "store",
    "previous_response_id"})
#: Accepted and ignored: none changes what the model generates or how the answer looks.
IGNORED = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                     "prompt_cache_options", "stream_options", "service_tier"})
#: Defined by the API, not honoured by Tandem: a 400 unless absent, null or "off".
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "background": lambda v: v is False,
    "conversation": lambda v: False,
    "include": lambda v: v == [],
    "truncation": lambda v: v == "disabled",
    "prompt": lambda v: False,
    "max_tool_calls": lambda v: False,
    "top_logprobs": lambda v: v == 0,
    "context_management": lambda v: v == [],
    "moderation": lambda v: False,
    "image": lambda v: False,
    "access_programs": lambda v: False,
    "background_options": lambda v: False,
}
_MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_REASONING_KEYS = frozenset({"effort", "summary", "generate_summary"})
MAX_METADATA_KEYS = 16
_NO_HEADERS: Mapping[str, str] = {}


@dataclass
class ResponsesRequest:
    """A validated Responses request: the chat body to serve it with, and what the response
    object echoes back."""

    model: str
    chat_body: JsonDict
    stream: bool
    store: bool
    #: This request's own input items (a string input becomes one user message item); what a
    #: later previous_response_id continues from, after the history it continued itself.
    input_items: list[JsonDict]
    #: The conversation before `input_items` (from previous_response_id).
    history: list[JsonDict]
    #: The request's settings, as the response object echoes them.
    echo: JsonDict
    #: chat param prefix -> the Responses param it came from (longest prefix wins).
    params: dict[str, str] = field(default_factory=dict)

    def chat_error(self, exc: TandemError) -> TandemError:
        """`exc` with its param (and the quoted name in its message) renamed to the Responses
        field; unchanged when its param is none or not a translated one."""
        if exc.param is None:
            return exc
        mapped = self._map(exc.param)
        if mapped == exc.param:
            return exc
        renamed = type(exc)(exc.message.replace(f"'{exc.param}'", f"'{mapped}'"), param=mapped)
        return renamed

    def _map(self, param: str) -> str:
        for prefix in sorted(self.params, key=len, reverse=True):
            rest = param[len(prefix):]
            if param.startswith(prefix) and (not rest or rest[0] in ".["):
                target = self.params[prefix]
                return target if target == "previous_response_id" else target + rest
        return param


def parse_responses(body: object, history: History) -> ResponsesRequest:
    """Validates a Responses request and translates it.

    Args:
      body: the decoded JSON body, of any type.
      history: the conversation of a stored response by id; raises InvalidRequest (param
        "previous_response_id") for an unknown one.
    Raises:
      InvalidRequest: naming the Responses field at fault.
    """
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {json_type(body)}")
    _check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required, a non-empty string", param="model")
    previous = get_str(body, "previous_response_id", non_empty=True)
    past = history(previous) if previous is not None else []
    items = _input_items(body.get("input"))
    instructions = get_str(body, "instructions")
    translator = _Translator()
    if instructions:
        translator.add({"role": "system", "content": instructions}, "instructions")
    for item in past:
        translator.item(item, "previous_response_id")
    for i, item in enumerate(items):
        translator.item(item, f"input[{i}]")
    if not translator.messages:
        raise InvalidRequest("'input' must hold at least one message", param="input")
    chat: JsonDict = {"model": model, "messages": translator.messages}
    params = dict(translator.params)
    params.update({"messages": "input", "max_tokens": "max_output_tokens",
                   "reasoning_effort": "reasoning.effort", "response_format": "text.format",
                   "response_format.json_schema": "text.format",
                   "tool_choice.function": "tool_choice"})
    echo = _settings(body, chat, params)
    store = get_bool(body, "store")
    echo.update(instructions=instructions, previous_response_id=previous,
                store=store is not False, metadata=_metadata(body))
    return ResponsesRequest(model, chat, bool(get_bool(body, "stream")), store is not False,
                            items, past, echo, params)


def _check_fields(body: JsonDict) -> None:
    for name, accepts in _REFUSED.items():
        value = body.get(name)
        if value is not None and not accepts(value):
            raise InvalidRequest(f"'{name}' is not supported by this server", param=name)
    for name in body:
        if name not in HONOURED and name not in IGNORED and name not in _REFUSED:
            raise InvalidRequest(f"unrecognized request argument '{name}'", param=name)


def _input_items(value: object) -> list[JsonDict]:
    if value is None:
        raise InvalidRequest("'input' is required", param="input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise must("input", "a string or an array of input items", value)
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise must(f"input[{i}]", "an object", item)
    return value


class _Translator:
    """Input items -> chat messages, remembering which item each message came from."""

    def __init__(self) -> None:
        self.messages: list[JsonDict] = []
        self.params: dict[str, str] = {}

    def add(self, message: JsonDict, source: str) -> None:
        self.params[f"messages[{len(self.messages)}]"] = source
        self.messages.append(message)

    def item(self, item: JsonDict, where: str) -> None:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            k = len(self.messages)
            self.add({"role": "tool", "tool_call_id": call_id,
                      "content": _output_text(item.get("output"), f"{where}.output")}, where)
            self.params[f"messages[{k}].content"] = f"{where}.output"
        elif kind == "reasoning":
            return  # the model's earlier reasoning does not go back into the prompt
        elif kind is None:
            raise InvalidRequest(f"'{where}.type' is required", param=f"{where}.type")
        else:
            raise InvalidRequest(f"'{where}.type' {kind!r} is not supported (only message, "
                                 "function_call, function_call_output and reasoning items)",
                                 param=f"{where}.type")

    def _message(self, item: JsonDict, where: str) -> None:
        role = item.get("role")
        if role not in _MESSAGE_ROLES:
            raise InvalidRequest(f"'{where}.role' must be one of "
                                 f"{', '.join(sorted(_MESSAGE_ROLES))}, got {role!r}",
                                 param=f"{where}.role")
        content = item.get("content")
        if not isinstance(content, (str, list)):
            raise must(f"{where}.content", "a string or an array of content parts", content)
        parts = content if isinstance(content, str) else [
            _part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
        self.add({"role": role, "content": parts}, where)

    def _call(self, item: JsonDict, where: str) -> None:
        call_id = _required_str(item, "call_id", where)
        name = _required_str(item, "name", where)
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise must(f"{where}.arguments", "a string of JSON", arguments)
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            # Calls after an assistant message (or after another call) belong to that turn.
            calls = last.setdefault("tool_calls", [])
            k = len(self.messages) - 1
        else:
            calls = []
            k = len(self.messages)
            self.add({"role": "assistant", "content": None, "tool_calls": calls}, where)
        self.params[f"messages[{k}].tool_calls[{len(calls)}].function.arguments"] = (
            f"{where}.arguments")
        self.params[f"messages[{k}].tool_calls[{len(calls)}]"] = where
        calls.append(call)


def _part(part: object, where: str) -> JsonDict:
    if not isinstance(part, dict):
        raise must(where, "an object", part)
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        text = part.get("text")
        if not isinstance(text, str):
            raise must(f"{where}.text", "a string", text)
        return {"type": "text", "text": text}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"'{where}.image_url' must be a URL or data URL (file_id is "
                                 "not supported)", param=f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise InvalidRequest(f"'{where}.type' {kind!r} is not supported (only input_text, "
                         "output_text and input_image)", param=f"{where}.type")


def _output_text(value: object, where: str) -> str:
    """A function_call_output's output: a string, or text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise InvalidRequest(f"'{where}[{j}]' must be an input_text part",
                                     param=f"{where}[{j}]")
            texts.append(_part(part, f"{where}[{j}]")["text"])
        return "\n".join(texts)
    raise must(where, "a string or an array of input_text parts", value)


def _required_str(item: JsonDict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise must(f"{where}.{key}", "a non-empty string", value)
    return value


# --- settings -----------------------------------------------------------------------------------


def _settings(body: JsonDict, chat: JsonDict, params: dict[str, str]) -> JsonDict:
    """Adds the translated settings to `chat`; returns their echo for the response object."""
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"), params)
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    text = get_object(body, "text")
    for key in text:
        if key != "format":
            raise InvalidRequest(f"'text.{key}' is not supported", param=f"text.{key}")
    fmt = get_object(text, "format", "text.format")
    if fmt:
        chat["response_format"] = _response_format(fmt)
    reasoning = get_object(body, "reasoning")
    for key in reasoning:
        if key not in _REASONING_KEYS:
            raise InvalidRequest(f"'reasoning.{key}' is not supported", param=f"reasoning.{key}")
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    return {
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "text": {"format": fmt or {"type": "text"}},
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "truncation": "disabled",
    }


def _tools(value: object, params: dict[str, str]) -> list[JsonDict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise must("tools", "an array of tools", value)
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise must(where, "an object", tool)
        if tool.get("type") != "function":
            raise InvalidRequest(f"'{where}.type' {tool.get('type')!r} is not supported: only "
                                 "function tools (no built-in tools)", param=f"{where}.type")
        spec = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
        tools.append({"type": "function", "function": spec})
        params[f"{where}.function"] = where
    return tools


def _tool_choice(value: object) -> object:
    if value is None or isinstance(value, str):
        return value  # "none" / "auto" / "required"; the chat parser checks the string
    if not isinstance(value, dict):
        raise must("tool_choice", "a string or an object", value)
    if value.get("type") != "function":
        raise InvalidRequest(f"'tool_choice.type' {value.get('type')!r} is not supported (only "
                             "'function')", param="tool_choice.type")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise must("tool_choice.name", "a non-empty string", name)
    return {"type": "function", "function": {"name": name}}


def _response_format(fmt: JsonDict) -> JsonDict:
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise InvalidRequest("'text.format.type' must be 'text', 'json_object' or "
                             f"'json_schema', got {kind!r}", param="text.format.type")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _metadata(body: JsonDict) -> JsonDict | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise must("metadata", "an object of string values", metadata)
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidRequest(f"'metadata' may hold at most {MAX_METADATA_KEYS} keys",
                             param="metadata")
    return dict(metadata)


def conversation(request: ResponsesRequest) -> Sequence[JsonDict]:
    """The items a later previous_response_id continues from (before this response's output)."""
    return [*request.history, *request.input_items]


def parse_chat(request: ResponsesRequest,
               headers: Mapping[str, str] = _NO_HEADERS) -> ParsedRequest:
    """The chat request that serves `request`, its errors naming Responses fields."""
    try:
        return parse_request(request.chat_body, "chat", headers)
    except TandemError as exc:
        raise request.chat_error(exc) from None
