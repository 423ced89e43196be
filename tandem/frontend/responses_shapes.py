"""Builders of the Responses API's JSON shapes: the response object, its output items, usage,
and one SSE event's bytes. Flat dict literals, in the shapes the official `openai` client's
models (openai.types.responses) parse; the caller fixes ids and times."""
from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from tandem.engines.types import Usage

JsonDict = dict[str, Any]


def new_id(prefix: str) -> str:
    """"<prefix>_<uuid4 hex>": resp_, msg_, fc_, rs_."""
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    """created_at: Unix time in whole seconds."""
    return int(time.time())


def sse(event: JsonDict) -> bytes:
    """One server-sent event: `event: <type>` and its JSON on one `data:` line."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def usage_body(usage: Usage, reasoning_tokens: int = 0) -> JsonDict:
    return {
        "input_tokens": usage.prompt_tokens,
        # Tandem's prefix cache has no billed writes: cache_write_tokens is always 0.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(response_id: str, created_at: int, model: str, status: str,
                    output: list[JsonDict], echo: JsonDict, usage: JsonDict | None = None,
                    incomplete_reason: str | None = None,
                    error: JsonDict | None = None) -> JsonDict:
    """The response object; `echo` holds the request's settings
    (tandem.frontend.responses_request.ResponsesRequest.echo)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {
            "reason": incomplete_reason},
        "model": model,
        "output": output,
        "usage": usage,
        **echo,
    }


def message_item(item_id: str, status: str, text: str | None = None) -> JsonDict:
    """An assistant message; `text` None: no content part yet (as output_item.added sends it)."""
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def text_part(text: str) -> JsonDict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, status: str, text: str | None = None) -> JsonDict:
    """The reasoning parser's text, as the item's reasoning_text content (no summary)."""
    content = [] if text is None else [reasoning_part(text)]
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": content}


def reasoning_part(text: str) -> JsonDict:
    return {"type": "reasoning_text", "text": text}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> JsonDict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def deleted(response_id: str) -> JsonDict:
    """DELETE /v1/responses/{id}'s answer."""
    return {"id": response_id, "object": "response.deleted", "deleted": True}
