"""Chat `messages` of an OpenAI request, validated into what the chat template takes.

The template sees each message as transformers' `apply_chat_template` documents it:
  - {"role", "content"}: content a string, or (a message with images) a list of text parts and
    TEMPLATE_IMAGE_PART; text-only part lists are joined with "\\n", as vLLM does;
  - an assistant message that called tools: "content" ("" when null) and "tool_calls", each
    {"id", "type": "function", "function": {"name", "arguments"}} with `arguments` decoded from
    OpenAI's JSON string into a dict: Hugging Face templates (Llama 3.1, Qwen2.5, Mistral, ...)
    write `arguments | tojson`, which would quote a string a second time;
  - a tool result: {"role": "tool", "content", "tool_call_id"} (and "name" when sent);
  - an assistant's earlier `reasoning_content` (a string) is passed on for templates that
    render it (Qwen3 drops it from past turns itself).
Other message fields (`name` outside tool results, `refusal`) do not reach the template.
The request's template variables (`chat_template_kwargs`, `reasoning_effort`) are read here too.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tandem.errors import InvalidRequest
from tandem.frontend.json_fields import get_object, get_str, must
from tandem.multimodal.chat import (
    IMAGE_PART_TYPES,
    MAX_IMAGES_PER_REQUEST,
    TEMPLATE_IMAGE_PART,
    ImageRef,
    image_part_url,
)

#: Chat roles passed through to the chat template.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: OpenAI's reasoning_effort values.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: apply_chat_template's own parameters, which a chat_template_kwargs key may not replace.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})


def parse_messages(value: object, images: list[ImageRef]) -> tuple[dict[str, Any], ...]:
    """The messages for the chat template; the image parts' URLs are appended to `images`.

    Raises:
        InvalidRequest: naming the message field at fault (e.g. "messages[2].tool_call_id").
    """
    if value is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(value, list):
        raise must("messages", "an array", value)
    if not value:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    out = [_message(message, f"messages[{i}]", images) for i, message in enumerate(value)]
    if len(images) > MAX_IMAGES_PER_REQUEST:
        raise InvalidRequest(f"'messages' may carry at most {MAX_IMAGES_PER_REQUEST} images, "
                             f"got {len(images)}", param="messages")
    return tuple(out)


def _message(message: object, where: str, images: list[ImageRef]) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise must(where, "an object", message)
    role = message.get("role")
    if role is None:
        raise InvalidRequest(f"'{where}.role' is required", param=f"{where}.role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidRequest(
            f"'{where}.role' must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
            param=f"{where}.role",
        )
    out: dict[str, Any] = {"role": role,
                           "content": _content(message.get("content"), role, where, images)}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            out["reasoning_content"] = reasoning
    elif role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise must(f"{where}.tool_call_id", "a non-empty string (the id of the call this "
                       "message answers)", call_id)
        out["tool_call_id"] = call_id
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise must(f"{where}.name", "a string", name)
            out["name"] = name
    return out


def _tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise must(where, "an array", value)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise must(at, "an object", call)
        kind = call.get("type", "function")
        if kind != "function":
            raise InvalidRequest(f"'{at}.type' must be 'function', got {kind!r}",
                                 param=f"{at}.type")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise must(f"{at}.id", "a string", call_id)
        function = call.get("function")
        if not isinstance(function, dict):
            raise must(f"{at}.function", "an object with 'name' and 'arguments'", function)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise must(f"{at}.function.name", "a non-empty string", name)
        arguments = _arguments(function.get("arguments"), f"{at}.function.arguments")
        entry: dict[str, Any] = {"type": "function",
                                 "function": {"name": name, "arguments": arguments}}
        if call_id is not None:
            entry["id"] = call_id
        calls.append(entry)
    return calls


def _arguments(value: object, param: str) -> dict[str, Any]:
    """A call's arguments as a dict: OpenAI sends a JSON string, some clients an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as exc:
            raise InvalidRequest(f"'{param}' is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise must(param, "a JSON object (or a string holding one)", value)
    return value


def _content(value: object, role: str, where: str,
             images: list[ImageRef]) -> str | list[Mapping[str, str]]:
    param = f"{where}.content"
    if isinstance(value, str):
        return value
    if value is None:
        if role == "assistant":  # an assistant turn that only called tools
            return ""
        raise InvalidRequest(f"'{param}' is required", param=param)
    if not isinstance(value, list):
        raise must(param, "a string or an array of content parts", value)
    texts: list[str] = []
    parts: list[Mapping[str, str]] = []  # in order, for a message with images
    for j, part in enumerate(value):
        part_param = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")  # type: ignore[union-attr]
            if not isinstance(text, str):
                raise must(f"{part_param}.text", "a string", text)
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif kind in IMAGE_PART_TYPES and isinstance(part, dict):
            images.append(ImageRef(image_part_url(part, part_param), part_param))
            parts.append(TEMPLATE_IMAGE_PART)
        elif kind == "image":
            # The template's own part type: it carries no image, so it would leave a
            # placeholder without one.
            raise InvalidRequest(
                f"'{part_param}.type' 'image' is not an OpenAI content part; send the image as "
                "{'type': 'image_url', 'image_url': {'url': ...}}",
                param=f"{part_param}.type",
            )
        elif not isinstance(part, dict):
            raise must(part_param, "an object", part)
        elif kind is None:
            raise InvalidRequest(f"'{part_param}.type' is required", param=f"{part_param}.type")
        else:
            raise InvalidRequest(
                f"'{part_param}.type' {kind!r} is not supported (only 'text', 'image_url' and "
                "'input_image')",
                param=f"{part_param}.type",
            )
    if len(parts) > len(texts):
        return parts
    # vLLM joins text parts the same way.
    return "\n".join(texts)


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs: extra template variables, none replacing a parameter of
    apply_chat_template itself."""
    kwargs = get_object(body, "chat_template_kwargs")
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequest(f"'chat_template_kwargs.{key}' may not be set: it is a parameter "
                                 "of the template call itself", param=f"chat_template_kwargs.{key}")
    return kwargs


def reasoning_effort(body: dict[str, Any]) -> str | None:
    """reasoning_effort, one of OpenAI's values (the template decides what it means)."""
    effort = get_str(body, "reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, "
                             f"got {effort!r}", param="reasoning_effort")
    return effort
