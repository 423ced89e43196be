"""Parsing and validation of OpenAI request bodies (POST /v1/chat/completions, /v1/completions).

`parse_request` takes the already JSON-decoded body (any Python value) and returns a frozen
`ParsedRequest`, or raises `InvalidRequest` naming the field at fault (`param` holds its path,
e.g. "messages[1].role", "nvext.top_k", "x-slo-ttft-ms"). Unknown fields are ignored. JSON null
counts as absent everywhere. Booleans are never accepted where a number is expected.

Precedence rules:
  - chat: `max_completion_tokens` wins over the deprecated `max_tokens`.
  - top-level vLLM extras (top_k, min_tokens, ignore_eos, repetition_penalty) win over the same
    fields in Dynamo's `nvext` (Dynamo treats the nvext copies as deprecated); both are validated.
  - `nvext.greed_sampling: true` forces temperature 0 whatever `temperature` says.
  - SLA targets: `nvext.router.ttft_target` / `itl_target` win over the headers `x-slo-ttft-ms` /
    `x-slo-tpot-ms`. All in milliseconds.
  - structured outputs (`response_format`, `guided_*`, `nvext.guided_*`): at most one, see
    tandem.frontend.guided_request.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tandem.engines.types import GuidedDecoding, SamplingParams
from tandem.errors import InvalidRequest
from tandem.frontend.guided_request import parse_guided
from tandem.multimodal.chat import (
    IMAGE_PART_TYPES,
    MAX_IMAGES_PER_REQUEST,
    TEMPLATE_IMAGE_PART,
    ImageRef,
    image_part_url,
)

Kind = Literal["chat", "completion"]

#: Chat roles passed through to the chat template.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
_UINT32_LIMIT = 2**32
_UINT64_LIMIT = 2**64
_NO_HEADERS: Mapping[str, str] = {}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request. None means "absent: use the default" (see `sampling`)."""

    kind: Kind
    model: str
    #: chat only: {"role", "content"} in order; content is a string, or (a message with images)
    #: a list of text parts and TEMPLATE_IMAGE_PART, as the chat template takes them.
    messages: tuple[dict[str, Any], ...] = ()
    #: chat only: the images, in the order their parts appear in `messages`.
    images: tuple[ImageRef, ...] = ()
    #: completion only: text, or token ids.
    prompt: str | tuple[int, ...] | None = None
    #: max_completion_tokens / max_tokens; None: the frontend picks from the context length.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: 0 disables (vLLM's -1 is normalised to 0).
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: None: no logprobs; k: the sampled token's logprob plus k alternatives.
    logprobs: int | None = None
    stream: bool = False
    #: stream_options.include_usage: send a final chunk with usage and no choices.
    include_usage: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    #: Latency targets for the router, milliseconds.
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None
    #: The client's own deadline for the whole request, seconds (`timeout` in the body, else the
    #: `x-request-timeout-ms` header); capped by the frontend's --request-timeout-s.
    timeout_s: float | None = None
    #: The structured-output constraint (response_format, guided_*); None: unconstrained.
    guided: GuidedDecoding | None = None

    def sampling(self, max_tokens: int) -> SamplingParams:
        """Engine sampling parameters, with `max_tokens` already decided by the frontend.

        Absent values take SamplingParams' defaults (temperature 1, top_p 1, top_k 0, min_p 0,
        repetition_penalty 1).
        """
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            top_logprobs=self.logprobs,
            guided=self.guided,
        )


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
        raise InvalidRequest(f"request body must be a JSON object, got {_json_type(body)}")
    model = body.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    nvext = _object(body, "nvext", "nvext")
    router = _object(nvext, "router", "nvext.router")

    messages: tuple[dict[str, Any], ...] = ()
    images: list[ImageRef] = []
    prompt: str | tuple[int, ...] | None = None
    if kind == "chat":
        messages = _messages(body.get("messages"), images)
        newest = _int(body, "max_completion_tokens", lo=1)
        max_tokens = _first(newest, _int(body, "max_tokens", lo=1))
        logprobs = _chat_logprobs(body)
    else:
        prompt = _prompt(body.get("prompt"))
        max_tokens = _int(body, "max_tokens", lo=1)
        logprobs = _int(body, "logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS)
        if _bool(body, "echo"):
            raise InvalidRequest("'echo' is not supported", param="echo")
        if body.get("suffix"):
            raise InvalidRequest("'suffix' is not supported", param="suffix")
        best_of = _int(body, "best_of", lo=1)
        if best_of is not None and best_of > 1:
            raise InvalidRequest("best_of > 1 is not supported", param="best_of")
    n = _int(body, "n", lo=1)
    if n is not None and n > 1:
        raise InvalidRequest("n > 1 is not supported", param="n")

    stream = bool(_bool(body, "stream"))
    include_usage = False
    if body.get("stream_options") is not None:
        if not stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        options = _object(body, "stream_options", "stream_options")
        include_usage = bool(_bool(options, "include_usage", "stream_options.include_usage"))

    temperature = _float(body, "temperature", lo=0.0, hi=2.0)
    if _bool(nvext, "greed_sampling", "nvext.greed_sampling"):
        temperature = 0.0
    top_k = _first(_int(body, "top_k", lo=-1), _int(nvext, "top_k", "nvext.top_k", lo=-1))
    min_tokens = _first(
        _int(body, "min_tokens", lo=0), _int(nvext, "min_tokens", "nvext.min_tokens", lo=0)
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
        top_p=_float(body, "top_p", lo=0.0, hi=1.0, lo_open=True),
        top_k=None if top_k is None else max(top_k, 0),
        min_p=_float(body, "min_p", lo=0.0, hi=1.0),
        seed=_int(body, "seed", lo=0, hi=_UINT64_LIMIT - 1),
        stop=_stop(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids", allow_empty=True),
        logprobs=logprobs,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=bool(
            _first(_bool(body, "ignore_eos"), _bool(nvext, "ignore_eos", "nvext.ignore_eos"))
        ),
        min_tokens=min_tokens or 0,
        repetition_penalty=_first(
            _float(body, "repetition_penalty", lo=0.0, lo_open=True),
            _float(nvext, "repetition_penalty", "nvext.repetition_penalty", lo=0.0, lo_open=True),
        ),
        frequency_penalty=_float(body, "frequency_penalty", lo=-2.0, hi=2.0) or 0.0,
        presence_penalty=_float(body, "presence_penalty", lo=-2.0, hi=2.0) or 0.0,
        skip_special_tokens=_first(_bool(body, "skip_special_tokens"), True),
        ttft_target_ms=_first(
            _float(router, "ttft_target", "nvext.router.ttft_target", lo=0.0, lo_open=True),
            _header_ms(headers, "x-slo-ttft-ms"),
        ),
        itl_target_ms=_first(
            _float(router, "itl_target", "nvext.router.itl_target", lo=0.0, lo_open=True),
            _header_ms(headers, "x-slo-tpot-ms"),
        ),
        timeout_s=_first(
            _float(body, "timeout", lo=0.0, lo_open=True),
            _ms_to_s(_header_ms(headers, "x-request-timeout-ms")),
        ),
        guided=parse_guided(body, nvext),
    )


# --- fields -------------------------------------------------------------------------------------


def _messages(value: object, images: list[ImageRef]) -> tuple[dict[str, Any], ...]:
    """The messages for the chat template; the image parts' URLs are appended to `images`."""
    if value is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(value, list):
        raise _must("messages", "an array", value)
    if not value:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _must(where, "an object", message)
        role = message.get("role")
        if role is None:
            raise InvalidRequest(f"'{where}.role' is required", param=f"{where}.role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'{where}.role' must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
                param=f"{where}.role",
            )
        out.append({"role": role,
                    "content": _content(message.get("content"), role, where, images)})
    if len(images) > MAX_IMAGES_PER_REQUEST:
        raise InvalidRequest(f"'messages' may carry at most {MAX_IMAGES_PER_REQUEST} images, "
                             f"got {len(images)}", param="messages")
    return tuple(out)


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
        raise _must(param, "a string or an array of content parts", value)
    texts: list[str] = []
    parts: list[Mapping[str, str]] = []  # in order, for a message with images
    for j, part in enumerate(value):
        part_param = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")  # type: ignore[union-attr]
            if not isinstance(text, str):
                raise _must(f"{part_param}.text", "a string", text)
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
            raise _must(part_param, "an object", part)
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


def _prompt(value: object) -> str | tuple[int, ...]:
    if value is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(value, list) and value and not _is_int(value[0]):
        if len(value) > 1:
            raise InvalidRequest("batched prompts are not supported", param="prompt")
        value = value[0]  # a batch of one: a string or a list of token ids
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        return value
    if isinstance(value, list):
        return _token_ids(value, "prompt", allow_empty=False)
    raise _must("prompt", "a string or an array of token ids", value)


def _token_ids(value: object, param: str, *, allow_empty: bool) -> tuple[int, ...]:
    if value is None and allow_empty:
        return ()
    if not isinstance(value, list):
        raise _must(param, "an array of token ids", value)
    if not value and not allow_empty:
        raise InvalidRequest(f"'{param}' must not be empty", param=param)
    for token in value:
        if not _is_int(token) or not 0 <= token < _UINT32_LIMIT:
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
        raise _must("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop"
        )
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InvalidRequest(f"'stop' must hold non-empty strings, got {s!r}", param="stop")
    return tuple(stops)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
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


# --- typed getters: each returns None when the key is absent or null --------------------------


def _int(obj: dict[str, Any], key: str, param: str | None = None, *,
         lo: int | None = None, hi: int | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    param = param or key
    if not _is_int(value):
        raise _must(param, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidRequest(f"'{param}' must be {_range(lo, hi)}, got {value}", param=param)
    return value  # type: ignore[no-any-return]


def _float(obj: dict[str, Any], key: str, param: str | None = None, *, lo: float | None = None,
           hi: float | None = None, lo_open: bool = False) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    param = param or key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _must(param, "a number", value)
    x = float(value)
    low_bad = lo is not None and (x <= lo if lo_open else x < lo)
    if not math.isfinite(x) or low_bad or (hi is not None and x > hi):
        raise InvalidRequest(f"'{param}' must be {_range(lo, hi, lo_open)}, got {x}", param=param)
    return x


def _bool(obj: dict[str, Any], key: str, param: str | None = None) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    param = param or key
    raise _must(param, "a boolean", value)


def _object(obj: dict[str, Any], key: str, param: str) -> dict[str, Any]:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _must(param, "an object", value)
    return value


def _must(param: str, what: str, value: object) -> InvalidRequest:
    """The error for a field of the wrong JSON type."""
    return InvalidRequest(f"'{param}' must be {what}, got {_json_type(value)}", param=param)


def _first(*values: Any) -> Any:
    """The first value that is not None (None when all are)."""
    for value in values:
        if value is not None:
            return value
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    low = f"{'>' if lo_open else '>='} {_num(lo)}" if lo is not None else ""
    high = f"<= {_num(hi)}" if hi is not None else ""
    return " and ".join(part for part in (low, high) if part)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number",
               str: "string", list: "array", dict: "object"}


def _json_type(value: object) -> str:
    """The JSON name of `value`'s type, for error messages."""
    return _JSON_TYPES.get(type(value), type(value).__name__)
