"""Builders of OpenAI response bodies: chat.completion, chat.completion.chunk, text_completion.

Each builder returns a plain dict ready for json.dumps, in the exact shape the official `openai`
client parses. They run once per streamed chunk, so they are flat dict literals with no
validation: the caller passes the completion id, model and `created` it fixed once per request
(`new_completion_id`, `created_now`).

Finish reasons: STOP -> "stop", LENGTH -> "length", CANCELLED -> "stop"; an answer that called
tools and was not cut by its length ends "tool_calls" (`finish_text`). OpenAI has no
"cancelled"; a cancelled stream normally has no reader left, and a non-standard value would break
clients that validate the field (vLLM's "abort" does), so like Dynamo we report "stop". A frontend
that must tell a client its request was cut short (a deadline) should send an error instead.

Token text for logprobs comes from a caller-supplied `token_text(token_id) -> str`, so this module
needs no tokenizer; "bytes" is the UTF-8 encoding of that text. Logprobs below -9999 (including
-inf, which JSON cannot carry) are reported as -9999.0, as vLLM does.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tandem.engines.types import FinishReason, TokenLogprob, Usage

TokenText = Callable[[int], str]
JsonDict = dict[str, Any]

FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
}
MIN_LOGPROB = -9999.0


def finish_text(reason: FinishReason, made_calls: bool = False) -> str:
    """The finish_reason string: "tool_calls" for an answer that called tools (unless cut by
    max_tokens or the context: then "length", as vLLM)."""
    if made_calls and reason is not FinishReason.LENGTH:
        return "tool_calls"
    return FINISH_REASONS[reason]


def new_completion_id(kind: str) -> str:
    """"chatcmpl-<uuid4 hex>" for kind "chat", "cmpl-<uuid4 hex>" for "completion"."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def created_now() -> int:
    """The "created" field: Unix time in whole seconds."""
    return int(time.time())


def usage_body(usage: Usage) -> JsonDict:
    """OpenAI's usage object, with prompt_tokens_details.cached_tokens and, always (as OpenAI
    sends it), completion_tokens_details with speculative decoding's drafted tokens in Predicted
    Outputs' names: accepted (in the output, counted in completion_tokens) and rejected
    (discarded). reasoning_tokens is left out: reasoning is not counted apart."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


# --- logprobs -----------------------------------------------------------------------------------


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText) -> JsonDict:
    """Chat's choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}.

    top_logprobs lists the alternatives in `TokenLogprob.top` (best first), so its length is the
    request's top_logprobs.
    """
    content = []
    for lp in logprobs:
        token = token_text(lp.token_id)
        value = lp.logprob
        content.append({
            "token": token,
            "logprob": value if value > MIN_LOGPROB else MIN_LOGPROB,
            "bytes": list(token.encode("utf-8", "replace")),
            "top_logprobs": [_top_entry(top.token_id, top.logprob, token_text) for top in lp.top],
        })
    return {"content": content}


def _top_entry(token_id: int, value: float, token_text: TokenText) -> JsonDict:
    token = token_text(token_id)
    return {
        "token": token,
        "logprob": value if value > MIN_LOGPROB else MIN_LOGPROB,
        "bytes": list(token.encode("utf-8", "replace")),
    }


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], token_text: TokenText, text_offset: int = 0
) -> tuple[JsonDict, int]:
    """Completions' choice.logprobs and the text offset that follows its last token.

    Returns ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}, next_offset).
    Each top_logprobs entry maps token text to logprob for the alternatives plus the sampled
    token (OpenAI: "up to logprobs+1 elements"). `text_offset` is the character offset of the
    first token in the completion text; pass the returned next_offset with the next chunk.
    """
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in logprobs:
        token = token_text(lp.token_id)
        value = lp.logprob if lp.logprob > MIN_LOGPROB else MIN_LOGPROB
        top: dict[str, float] = {}
        for alt in lp.top:
            text = token_text(alt.token_id)
            if text not in top:  # two ids may decode alike; keep the likelier (listed first)
                top[text] = alt.logprob if alt.logprob > MIN_LOGPROB else MIN_LOGPROB
        top.setdefault(token, value)
        tokens.append(token)
        values.append(value)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
    return body, text_offset


def _body(obj: str, completion_id: str, model: str, created: int, choices: list[JsonDict],
          usage: Usage | None = None) -> JsonDict:
    body: JsonDict = {"id": completion_id, "object": obj, "created": created, "model": model,
                      "choices": choices}
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def _choice(key: str, value: object, logprobs: JsonDict | None,
            finish_reason: FinishReason | str | None, index: int = 0) -> list[JsonDict]:
    """choices for one answer: {"index": index, key: value, "logprobs", "finish_reason"}."""
    if isinstance(finish_reason, FinishReason):
        finish_reason = FINISH_REASONS[finish_reason]
    return [{"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}]


def with_choices(bodies: list[JsonDict], usage: Usage | None) -> JsonDict:
    """One response of several choices (`n`) from the bodies of each (built with their
    `index`): the first body's id and fields, every body's choice, the usage of all."""
    body = {**bodies[0], "choices": [c for b in bodies for c in b["choices"]]}
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


# --- tool calls ---------------------------------------------------------------------------------


def tool_call(call_id: str, name: str, arguments: str) -> JsonDict:
    """An entry of a non-streamed message's tool_calls."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_call_start(index: int, call_id: str, name: str) -> JsonDict:
    """A streamed call's first delta.tool_calls entry: id, type and name, no arguments yet."""
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": ""}}


def tool_call_arguments(index: int, fragment: str) -> JsonDict:
    """A later delta.tool_calls entry: a fragment of call `index`'s arguments."""
    return {"index": index, "function": {"arguments": fragment}}


# --- chat ---------------------------------------------------------------------------------------


def chat_completion(
    completion_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: FinishReason,
    usage: Usage,
    logprobs: JsonDict | None = None,
    tool_calls: list[JsonDict] | None = None,
    reasoning: str | None = None,
    index: int = 0,
) -> JsonDict:
    """A non-streamed chat.completion; `logprobs` from `chat_logprobs` when asked for,
    `tool_calls` from `tool_call`, `reasoning` (reasoning_content) from a reasoning parser.
    A message with calls and no text has content null."""
    message: JsonDict = {"role": "assistant", "content": text or (None if tool_calls else "")}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return _body("chat.completion", completion_id, model, created,
                 _choice("message", message, logprobs,
                         finish_text(finish_reason, bool(tool_calls)), index), usage)


def chat_chunk_first(completion_id: str, model: str, created: int, index: int = 0) -> JsonDict:
    """The first chat.completion.chunk of a stream (of each choice):
    delta {"role": "assistant", "content": ""}."""
    return _body("chat.completion.chunk", completion_id, model, created,
                 _choice("delta", {"role": "assistant", "content": ""}, None, None, index))


def chat_chunk(
    completion_id: str, model: str, created: int, text: str, logprobs: JsonDict | None = None,
    index: int = 0,
) -> JsonDict:
    """A chat.completion.chunk carrying text (delta {"content": text}) and its tokens' logprobs."""
    return _body("chat.completion.chunk", completion_id, model, created,
                 _choice("delta", {"content": text}, logprobs, None, index))


def chat_chunk_delta(completion_id: str, model: str, created: int, delta: JsonDict,
                     logprobs: JsonDict | None = None, index: int = 0) -> JsonDict:
    """A chat.completion.chunk with any delta: {"reasoning_content"}, {"content"} or
    {"tool_calls": [tool_call_start(...)]} / [tool_call_arguments(...)]."""
    return _body("chat.completion.chunk", completion_id, model, created,
                 _choice("delta", delta, logprobs, None, index))


def chat_chunk_last(
    completion_id: str, model: str, created: int, finish_reason: FinishReason,
    made_calls: bool = False, index: int = 0,
) -> JsonDict:
    """The chunk that ends a chat stream (a choice of it): empty delta and the finish reason."""
    return _body("chat.completion.chunk", completion_id, model, created,
                 _choice("delta", {}, None, finish_text(finish_reason, made_calls), index))


def chat_chunk_usage(completion_id: str, model: str, created: int, usage: Usage) -> JsonDict:
    """With stream_options.include_usage: the very last chunk, no choices, the usage."""
    return _body("chat.completion.chunk", completion_id, model, created, [], usage)


# --- completions --------------------------------------------------------------------------------


def text_completion(
    completion_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: FinishReason,
    usage: Usage,
    logprobs: JsonDict | None = None,
    index: int = 0,
) -> JsonDict:
    """A non-streamed text_completion; `logprobs` from `completion_logprobs` when asked for."""
    return _body("text_completion", completion_id, model, created,
                 _choice("text", text, logprobs, finish_reason, index), usage)


def completion_chunk(
    completion_id: str,
    model: str,
    created: int,
    text: str,
    logprobs: JsonDict | None = None,
    finish_reason: FinishReason | None = None,
    index: int = 0,
) -> JsonDict:
    """A streamed text_completion chunk; the last one carries `finish_reason` (text may be "")."""
    return _body("text_completion", completion_id, model, created,
                 _choice("text", text, logprobs, finish_reason, index))


def completion_chunk_usage(completion_id: str, model: str, created: int, usage: Usage) -> JsonDict:
    """With stream_options.include_usage: the very last chunk, no choices, the usage."""
    return _body("text_completion", completion_id, model, created, [], usage)
