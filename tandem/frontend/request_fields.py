"""Every field a request body may carry, in one place: honoured, accepted and ignored, refused.

- HONOURED: parsed by tandem.frontend.openai_request (and its helpers) and acted on.
- IGNORED: OpenAI fields accepted and ignored, each with the reason none of them changes what
  the model generates or what the response looks like.
- REFUSED: fields (OpenAI's, and vLLM extensions a client might expect to work) that Tandem does
  not honour: a 400 naming the field unless it is absent, null, or set to the value that asks
  for nothing (`logit_bias: {}`, `store: false`, `modalities: ["text"]`, ...).
- Any other field (another server's extension) is ignored, and the frontend logs a warning
  naming it, as vLLM does (`unknown_fields`).

The README's "Request fields" section lists IGNORED and REFUSED; a unit test keeps them equal.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tandem.errors import InvalidRequest

Kind = Literal["chat", "completion"]

_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "stream",
    "stream_options", "n", "frequency_penalty", "presence_penalty", "response_format",
    # vLLM's extensions
    "top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids",
    "skip_special_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    # NVIDIA Dynamo's extensions, and the client's own deadline (seconds)
    "nvext", "timeout",
    # Tandem's: false keeps the engine from speculating for this request
    "speculative_decoding",
})
HONOURED: dict[Kind, frozenset[str]] = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                       "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                       "reasoning_effort"},
    "completion": _COMMON | {"prompt", "best_of"},
}

#: Accepted and ignored, with the reason that is harmless.
IGNORED: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; Tandem neither stores nor logs it",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring, like 'user'",
    "metadata": "tags for stored completions; nothing is stored",
    "prompt_cache_key": "prefix caching is automatic: KV blocks are matched by token content",
    "prompt_cache_retention": "prefix caching is automatic, the cache evicts by LRU",
    "prompt_cache_options": "prefix caching is automatic, the cache evicts by LRU",
    "stream_options.include_obfuscation": "streamed chunks carry no obfuscation field",
    "guided_decoding_backend": "every engine enforces constraints with xgrammar",
    "guided_whitespace_pattern": "JSON output is compact, or as --json-whitespace allows",
}


@dataclass(frozen=True)
class Refusal:
    name: str
    kinds: tuple[Kind, ...]
    #: Whether a value asks for nothing Tandem would leave undone (null is always accepted).
    accepts: Callable[[Any], bool]
    why: str


def _off(value: Any) -> bool:
    return value is False or value == [] or value == {} or value == ""


def _never(value: Any) -> bool:
    """For objects whose mere presence asks for the feature (`web_search_options: {}` is a web
    search with default options): only absent or null is accepted."""
    return False


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == a and type(value) is type(a) for a in allowed)


_BOTH: tuple[Kind, ...] = ("chat", "completion")
REFUSED: tuple[Refusal, ...] = (
    Refusal("logit_bias", _BOTH, _off, "is not supported (no per-token biases)"),
    Refusal("audio", ("chat",), _never, "is not supported: the output is text only"),
    Refusal("modalities", ("chat",), lambda v: v in (["text"], []),
            "may only be [\"text\"]: the output is text only"),
    Refusal("prediction", ("chat",), _never, "(predicted outputs) is not supported"),
    Refusal("web_search_options", ("chat",), _never,
            "is not supported: there is no web search (any value, {} included, asks for one)"),
    Refusal("store", ("chat",), _off, "must be false: completions are not stored"),
    Refusal("service_tier", ("chat",), _is("auto", "default"),
            "may only be 'auto' or 'default': there is one service tier"),
    Refusal("verbosity", ("chat",), _off, "is not supported"),
    Refusal("moderation", ("chat",), _off, "is not supported: there is no moderation"),
    Refusal("functions", ("chat",), _off,
            "(legacy function calling) is not supported: send 'tools' instead"),
    Refusal("function_call", ("chat",), _off,
            "(legacy function calling) is not supported: send 'tool_choice' instead"),
    Refusal("echo", _BOTH, _off, "is not supported"),
    Refusal("suffix", ("completion",), _off, "is not supported"),
    Refusal("best_of", ("chat",), _is(1), "applies to /v1/completions only (send n)"),
    # vLLM extensions that would change the output if they were honoured
    Refusal("add_generation_prompt", ("chat",), _is(True), "may only be true"),
    Refusal("continue_final_message", ("chat",), _off, "is not supported"),
    Refusal("chat_template", ("chat",), _off,
            "is not supported: the model directory's chat template is used"),
    Refusal("documents", ("chat",), _off, "is not supported"),
    Refusal("include_stop_str_in_output", _BOTH, _off, "is not supported"),
    Refusal("prompt_logprobs", _BOTH, _off, "is not supported"),
    Refusal("truncate_prompt_tokens", _BOTH, _off, "is not supported"),
    Refusal("use_beam_search", _BOTH, _off, "is not supported"),
    Refusal("allowed_token_ids", _BOTH, _off, "is not supported"),
    Refusal("bad_words", _BOTH, _off, "is not supported"),
    Refusal("structured_outputs", _BOTH, _off,
            "is not supported: send response_format or guided_json/regex/choice/grammar"),
    # chat-only fields sent to /v1/completions
    *(Refusal(name, ("completion",), _off, "applies to /v1/chat/completions only")
      for name in ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                   "reasoning_effort")),
)


def check_fields(body: dict[str, Any], kind: Kind) -> list[str]:
    """Raises InvalidRequest for the first refused field that asks for something; returns the
    fields of `body` that are in no list (to be logged)."""
    for refusal in REFUSED:
        value = body.get(refusal.name)
        if value is not None and kind in refusal.kinds and not refusal.accepts(value):
            raise InvalidRequest(f"'{refusal.name}' {refusal.why}", param=refusal.name)
    known = HONOURED[kind]
    refused = {r.name for r in REFUSED}
    return sorted(k for k in body if k not in known and k not in IGNORED and k not in refused)
