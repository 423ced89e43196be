"""Parsing and validation of OpenAI request bodies (POST /v1/chat/completions, /v1/completions).

`parse_request` takes the already JSON-decoded body (any Python value) and returns a frozen
`ParsedRequest`, or raises `InvalidRequest` naming the field at fault (`param` holds its path,
e.g. "messages[1].role", "nvext.top_k", "x-slo-ttft-ms"). JSON null counts as absent everywhere.
Booleans are never accepted where a number is expected. Which fields are honoured, accepted and
ignored, or refused is listed in one place, tandem.frontend.request_fields; a field in none of
its lists is ignored and logged.

Precedence rules:
  - chat: `max_completion_tokens` wins over the deprecated `max_tokens`.
  - top-level vLLM extras (top_k, min_tokens, ignore_eos, repetition_penalty) and Tandem's
    `speculative_decoding` win over the same fields in Dynamo's `nvext` (Dynamo treats the nvext
    copies as deprecated); both are validated.
  - `nvext.greed_sampling: true` forces temperature 0 whatever `temperature` says.
  - SLA targets: `nvext.router.ttft_target` / `itl_target` win over the headers `x-slo-ttft-ms` /
    `x-slo-tpot-ms`. All in milliseconds.
  - structured outputs (`response_format`, `guided_*`, `nvext.guided_*`): at most one, see
    tandem.frontend.guided_request; tool_choice required or named brings its own (see
    tandem.frontend.tool_request) and excludes them.
  - `reasoning_effort` reaches the chat template as the variable of that name, over a
    `chat_template_kwargs` entry of the same name.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from tandem.errors import InvalidRequest
from tandem.frontend.chat_messages import (
    CHAT_ROLES,
    parse_messages,
    reasoning_effort,
    template_kwargs,
)
from tandem.frontend.choices import MAX_CHOICES
from tandem.frontend.guided_request import parse_guided
from tandem.frontend.json_fields import (
    first,
    get_bool,
    get_float,
    get_int,
    get_object,
    is_int,
    json_type,
    must,
)
from tandem.frontend.parsed_request import ParsedRequest
from tandem.frontend.request_fields import Kind, check_fields
from tandem.frontend.tool_request import ToolRequest, guided_for, parse_tools
from tandem.multimodal.chat import ImageRef

__all__ = ["CHAT_ROLES", "Kind", "ParsedRequest", "parse_request"]
log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
_UINT32_LIMIT = 2**32
_UINT64_LIMIT = 2**64
_NO_HEADERS: Mapping[str, str] = {}


def parse_request(
    body: object, kind: Kind, headers: Mapping[str, str] = _NO_HEADERS
) -> ParsedRequest:
    """Validates `body` for endpoint `kind` ("chat" or "completion").

    Args:
      body: the decoded JSON body, of any type.
      kind: "chat" for /v1/chat/completions, "completion" for /v1/completions.
      headers: the HTTP request headers (looked up case-insensitively); only the SLA headers
        are read.
    Raises:
      InvalidRequest: naming the field at fault in the message and in `param`.
      ValueError: `kind` is neither "chat" nor "completion" (a programming error).
    """
    if kind not in ("chat", "completion"):
        raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {json_type(body)}")
    model = body.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    unknown = check_fields(body, kind)
    if unknown:
        log.warning("request fields ignored", extra={"fields": unknown})
    nvext = get_object(body, "nvext")
    router = get_object(nvext, "router", "nvext.router")

    messages: tuple[dict[str, Any], ...] = ()
    images: list[ImageRef] = []
    prompt: str | tuple[int, ...] | None = None
    guided = parse_guided(body, nvext)
    tools: ToolRequest | None = None
    if kind == "chat":
        messages = parse_messages(body.get("messages"), images)
        newest = get_int(body, "max_completion_tokens", lo=1)
        max_tokens = first(newest, get_int(body, "max_tokens", lo=1))
        logprobs = _chat_logprobs(body)
        tools = parse_tools(body, guided)
        guided = guided or guided_for(tools)
    else:
        prompt = _prompt(body.get("prompt"))
        max_tokens = get_int(body, "max_tokens", lo=1)
        logprobs = get_int(body, "logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS)
    n = get_int(body, "n", lo=1, hi=MAX_CHOICES) or 1
    best_of = _best_of(body, kind, n)

    stream = bool(get_bool(body, "stream"))
    include_usage = False
    if body.get("stream_options") is not None:
        if not stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        options = get_object(body, "stream_options")
        include_usage = bool(get_bool(options, "include_usage", "stream_options.include_usage"))

    temperature = get_float(body, "temperature", lo=0.0, hi=2.0)
    if get_bool(nvext, "greed_sampling", "nvext.greed_sampling"):
        temperature = 0.0
    top_k = first(get_int(body, "top_k", lo=-1), get_int(nvext, "top_k", "nvext.top_k", lo=-1))
    min_tokens = first(
        get_int(body, "min_tokens", lo=0), get_int(nvext, "min_tokens", "nvext.min_tokens", lo=0)
    )
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(
            f"'min_tokens' ({min_tokens}) must not exceed the maximum number of tokens "
            f"({max_tokens})",
            param="min_tokens",
        )

    return ParsedRequest(
        kind=kind,
        model=model,
        messages=messages,
        images=tuple(images),
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=get_float(body, "top_p", lo=0.0, hi=1.0, lo_open=True),
        top_k=None if top_k is None else max(top_k, 0),
        min_p=get_float(body, "min_p", lo=0.0, hi=1.0),
        seed=get_int(body, "seed", lo=0, hi=_UINT64_LIMIT - 1),
        stop=_stop(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids", allow_empty=True),
        logprobs=logprobs,
        stream=stream,
        n=n,
        best_of=best_of,
        include_usage=include_usage,
        ignore_eos=bool(
            first(get_bool(body, "ignore_eos"), get_bool(nvext, "ignore_eos", "nvext.ignore_eos"))
        ),
        min_tokens=min_tokens or 0,
        repetition_penalty=first(
            get_float(body, "repetition_penalty", lo=0.0, lo_open=True),
            get_float(nvext, "repetition_penalty", "nvext.repetition_penalty", lo=0.0,
                      lo_open=True),
        ),
        frequency_penalty=get_float(body, "frequency_penalty", lo=-2.0, hi=2.0) or 0.0,
        presence_penalty=get_float(body, "presence_penalty", lo=-2.0, hi=2.0) or 0.0,
        skip_special_tokens=first(get_bool(body, "skip_special_tokens"), True),
        ttft_target_ms=first(
            get_float(router, "ttft_target", "nvext.router.ttft_target", lo=0.0, lo_open=True),
            _header_ms(headers, "x-slo-ttft-ms"),
        ),
        itl_target_ms=first(
            get_float(router, "itl_target", "nvext.router.itl_target", lo=0.0, lo_open=True),
            _header_ms(headers, "x-slo-tpot-ms"),
        ),
        timeout_s=first(
            get_float(body, "timeout", lo=0.0, lo_open=True),
            _ms_to_s(_header_ms(headers, "x-request-timeout-ms")),
        ),
        guided=guided,
        tools=tools,
        template_kwargs=template_kwargs(body),
        reasoning_effort=reasoning_effort(body),
        speculative=first(
            get_bool(body, "speculative_decoding"),
            get_bool(nvext, "speculative_decoding", "nvext.speculative_decoding"),
            True,
        ),
    )


# --- fields -------------------------------------------------------------------------------------


def _prompt(value: object) -> str | tuple[int, ...]:
    if value is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(value, list) and value and not is_int(value[0]):
        if len(value) > 1:
            raise InvalidRequest("batched prompts are not supported", param="prompt")
        value = value[0]  # a batch of one: a string or a list of token ids
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        return value
    if isinstance(value, list):
        return _token_ids(value, "prompt", allow_empty=False)
    raise must("prompt", "a string or an array of token ids", value)


def _token_ids(value: object, param: str, *, allow_empty: bool) -> tuple[int, ...]:
    if value is None and allow_empty:
        return ()
    if not isinstance(value, list):
        raise must(param, "an array of token ids", value)
    if not value and not allow_empty:
        raise InvalidRequest(f"'{param}' must not be empty", param=param)
    for token in value:
        if not is_int(token) or not 0 <= token < _UINT32_LIMIT:
            raise InvalidRequest(
                f"'{param}' must contain only non-negative integer token ids, got {token!r}",
                param=param,
            )
    return tuple(value)


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise must("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop"
        )
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InvalidRequest(f"'stop' must hold non-empty strings, got {s!r}", param="stop")
    return tuple(stops)


def _best_of(body: dict[str, Any], kind: Kind, n: int) -> int:
    """Completions' best_of: how many choices to generate, of which the n likeliest (highest
    mean token logprob) are returned. Not with stream (OpenAI's rule: the best is known only at
    the end); chat refuses it in check_fields."""
    best_of = get_int(body, "best_of", lo=1, hi=MAX_CHOICES) if kind == "completion" else None
    if best_of is None:
        return n
    if best_of < n:
        raise InvalidRequest(f"'best_of' ({best_of}) must be at least 'n' ({n})", param="best_of")
    if best_of > n and get_bool(body, "stream"):
        raise InvalidRequest("'best_of' cannot be used with 'stream'", param="best_of")
    return best_of


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    return (top or 0) if wanted else None


def _ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:  # a plain dict is case-sensitive; HTTP header names are not
        raw = next((v for k, v in headers.items() if k.lower() == name), None)
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InvalidRequest(
            f"header '{name}' must be a positive number of milliseconds, got {raw!r}", param=name
        )
    return value
