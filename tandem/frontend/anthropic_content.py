"""Anthropic Messages `system` and `messages`, translated into Chat Completions messages.

  - `system` (a string or text blocks) -> one leading {"role": "system"} message;
  - a user message -> its `tool_result` blocks first, each a {"role": "tool"} message (with the
    name of the tool_use it answers, for templates that render it), then one user message with
    the rest: text blocks and images (base64 source -> a data: URL, url source -> the URL);
  - an assistant message -> {"role": "assistant"} with its text as content, `tool_use` blocks as
    tool_calls (input as the arguments object) and `thinking` blocks as reasoning_content.
A conversation may not end with an assistant turn: Anthropic continues such a turn (prefill),
which the chat template cannot express, so it is a 400 (as Anthropic answers for models without
prefill). `cache_control` is accepted everywhere and ignored: prefix caching is automatic.

Every chat path is recorded against the Anthropic path it came from (`ParamMap`), so that an
error raised further on (by the chat parser, the image fetcher) names the client's field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidRequest
from tandem.frontend.json_fields import must

#: Block keys accepted and ignored on every block: prefix caching needs no markers.
_ANY_BLOCK = frozenset({"type", "cache_control"})
_BLOCK_KEYS: dict[str, frozenset[str]] = {
    "text": _ANY_BLOCK | {"text", "citations"},
    "image": _ANY_BLOCK | {"source"},
    "tool_use": _ANY_BLOCK | {"id", "name", "input"},
    "tool_result": _ANY_BLOCK | {"tool_use_id", "content", "is_error"},
    "thinking": _ANY_BLOCK | {"thinking", "signature"},
}
_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking")


@dataclass
class ParamMap:
    """Chat field paths -> the Anthropic paths they were translated from (longest prefix wins)."""

    prefixes: dict[str, str] = field(default_factory=dict)

    def add(self, chat: str, anthropic: str) -> None:
        self.prefixes[chat] = anthropic

    def to_anthropic(self, param: str) -> str:
        best = ""
        for chat in self.prefixes:
            if len(chat) > len(best) and (param == chat or param.startswith((chat + ".",
                                                                             chat + "["))):
                best = chat
        return self.prefixes[best] + param[len(best):] if best else param


def chat_messages(system: object, messages: object, params: ParamMap) -> list[dict[str, Any]]:
    """The Chat Completions `messages` of an Anthropic request.

    Raises:
        InvalidRequest: naming the Anthropic field at fault (e.g. "messages[1].content[0].id").
    """
    out: list[dict[str, Any]] = []
    if system is not None:
        text = system if isinstance(system, str) else _texts(system, "system")
        if text:
            params.add(f"messages[{len(out)}]", "system")
            out.append({"role": "system", "content": text})
    if messages is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(messages, list):
        raise must("messages", "an array", messages)
    if not messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    tool_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise must(where, "an object", message)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise InvalidRequest(f"'{where}.{extra[0]}' is not a message field (messages carry "
                                 "'role' and 'content')", param=f"{where}.{extra[0]}")
        role = message.get("role")
        if role == "user":
            out += _user(message.get("content"), where, len(out), params, tool_names)
        elif role == "assistant":
            if i == len(messages) - 1:
                raise InvalidRequest(
                    f"'{where}.role' is assistant in the last turn: continuing it (prefill) is "
                    "not supported; end the conversation with a user turn", param=f"{where}.role")
            out.append(_assistant(message.get("content"), where, len(out), params, tool_names))
        else:
            raise InvalidRequest(f"'{where}.role' must be 'user' or 'assistant', got {role!r}",
                                 param=f"{where}.role")
    return out


def _blocks(content: object, where: str, allowed: tuple[str, ...]) -> list[dict[str, Any]]:
    """The content blocks of a message, each checked for its type and keys."""
    param = f"{where}.content"
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        raise InvalidRequest(f"'{param}' is required", param=param)
    if not isinstance(content, list):
        raise must(param, "a string or an array of content blocks", content)
    for j, block in enumerate(content):
        at = f"{param}[{j}]"
        if not isinstance(block, dict):
            raise must(at, "an object", block)
        kind = block.get("type")
        if kind not in allowed:
            raise InvalidRequest(f"'{at}.type' must be one of {', '.join(allowed)} here, got "
                                 f"{kind!r}", param=f"{at}.type")
        extra = _set_keys(block, _BLOCK_KEYS[kind])
        if extra:
            raise InvalidRequest(f"'{at}.{extra[0]}' is not supported on a {kind} block",
                                 param=f"{at}.{extra[0]}")
        if kind == "text" and block.get("citations"):
            raise InvalidRequest(f"'{at}.citations' is not supported", param=f"{at}.citations")
    return content


def _text(block: dict[str, Any], at: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise must(f"{at}.text", "a string", text)
    return text


def _set_keys(block: dict[str, Any], known: frozenset[str] | set[str]) -> list[str]:
    """The block's keys outside `known` that carry a value: a block the client read from a
    response and sends back (the official clients' model_dump) has its unset fields as null."""
    return sorted(k for k, v in block.items() if k not in known and v is not None)


def _texts(value: object, where: str) -> str:
    """Text blocks (system, a tool result) joined with newlines, as chat joins text parts."""
    if not isinstance(value, list):
        raise must(where, "a string or an array of text blocks", value)
    texts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise InvalidRequest(f"'{at}' must be a text block", param=at)
        extra = _set_keys(block, _BLOCK_KEYS["text"])
        if extra:
            raise InvalidRequest(f"'{at}.{extra[0]}' is not supported on a text block",
                                 param=f"{at}.{extra[0]}")
        texts.append(_text(block, at))
    return "\n".join(texts)


def _image_url(block: dict[str, Any], at: str) -> str:
    source = block.get("source")
    if not isinstance(source, dict):
        raise must(f"{at}.source", "an object", source)
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise must(f"{at}.source.media_type", "an image media type", media_type)
        if not isinstance(data, str) or not data:
            raise must(f"{at}.source.data", "a non-empty base64 string", data)
        return f"data:{media_type};base64,{data}"
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise must(f"{at}.source.url", "a non-empty string", url)
        return url
    raise InvalidRequest(f"'{at}.source.type' must be 'base64' or 'url' (files are not "
                         f"supported), got {kind!r}", param=f"{at}.source.type")


def _user(content: object, where: str, first: int, params: ParamMap,
          tool_names: dict[str, str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    user_index = first + sum(1 for b in _blocks(content, where, _USER_BLOCKS)
                             if b["type"] == "tool_result")
    for j, block in enumerate(_blocks(content, where, _USER_BLOCKS)):
        at = f"{where}.content[{j}]"
        if block["type"] == "tool_result":
            params.add(f"messages[{first + len(results)}]", at)
            results.append(_tool_result(block, at, tool_names))
            continue
        params.add(f"messages[{user_index}].content[{len(parts)}]", at)
        if block["type"] == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        else:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
    if not parts:
        return results
    params.add(f"messages[{user_index}]", where)
    return [*results, {"role": "user", "content": parts}]


def _tool_result(block: dict[str, Any], at: str, tool_names: dict[str, str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise must(f"{at}.tool_use_id", "a non-empty string (the id of the tool_use it answers)",
                   call_id)
    content = block.get("content")
    text = content if isinstance(content, str) else (
        "" if content is None else _texts(content, f"{at}.content"))
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise must(f"{at}.is_error", "a boolean", is_error)
    if is_error:  # chat templates have no error flag: the model reads it in the text
        text = f"Error: {text}"
    message = {"role": "tool", "content": text, "tool_call_id": call_id}
    if call_id in tool_names:
        message["name"] = tool_names[call_id]
    return message


def _assistant(content: object, where: str, index: int, params: ParamMap,
               tool_names: dict[str, str]) -> dict[str, Any]:
    params.add(f"messages[{index}]", where)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, where, _ASSISTANT_BLOCKS)):
        at = f"{where}.content[{j}]"
        if block["type"] == "text":
            texts.append(_text(block, at))
        elif block["type"] == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise must(f"{at}.thinking", "a string", thinking)
            reasoning.append(thinking)
        else:
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id:
                raise must(f"{at}.id", "a non-empty string", call_id)
            if not isinstance(name, str) or not name:
                raise must(f"{at}.name", "a non-empty string", name)
            if not isinstance(arguments, dict):
                raise must(f"{at}.input", "an object", arguments)
            params.add(f"messages[{index}].tool_calls[{len(calls)}]", at)
            tool_names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": arguments}})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message
