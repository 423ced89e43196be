"""Tandem's sampling parameters and results in TensorRT-LLM's terms.

Upstream field names: tensorrt_llm/sampling_params.py (SamplingParams; None means "the C++
runtime default"; GuidedDecodingParams: json, regex, grammar, json_object, structural_tag, at
most one set); results: tensorrt_llm/executor/result.py (CompletionOutput.logprobs is a
list of {token_id: Logprob(logprob, rank)} per generated token, finish_reason one of 'stop',
'length', 'timeout', 'cancelled').
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.engines.guided.grammar import choice_ebnf, to_grammar
from tandem.engines.types import (
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)
from tandem.errors import DeadlineExceeded, TandemError, Unavailable

_FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,
}


def sampling_kwargs(params: SamplingParams, eos_ids: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments of TensorRT-LLM's SamplingParams for `params`.

    end_id is always given: workers skip the tokenizer, and without one upstream's
    LLM._prepare_sampling_params cannot fill it in. Further EOS ids become stop tokens.
    """
    end_id = eos_ids[0] if eos_ids else -1
    stop = list(params.stop_token_ids)
    if not params.ignore_eos:
        stop += [t for t in eos_ids[1:] if t not in stop]
    out: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "end_id": end_id,
        "pad_id": end_id,
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": stop or None,
        "detokenize": False,
    }
    if params.is_greedy:
        out["top_k"] = 1
    else:
        out["temperature"] = params.temperature
        if params.top_p < 1.0:
            out["top_p"] = params.top_p
        if params.top_k > 0:
            out["top_k"] = params.top_k
        if params.min_p > 0.0:
            out["min_p"] = params.min_p
    if params.seed is not None:
        out["seed"] = params.seed
    if params.repetition_penalty != 1.0:
        out["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty != 0.0:
        out["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty != 0.0:
        out["frequency_penalty"] = params.frequency_penalty
    if params.min_tokens > 0:
        out["min_tokens"] = params.min_tokens
    if params.top_logprobs is not None:
        # Upstream returns the top `logprobs` tokens plus the sampled one; ask for one at least
        # so that the sampled token's own logprob comes back (as Dynamo does).
        out["logprobs"] = max(1, params.top_logprobs)
    return out


def guided_kwargs(guided: GuidedDecoding) -> dict[str, Any]:
    """Keyword arguments of TensorRT-LLM's GuidedDecodingParams for a constraint.

    JSON schemas and JSON objects go as the EBNF grammar the other engines compile them to:
    upstream compiles its `json` and `json_object` with xgrammar's unbounded whitespace, which
    would ignore the constraint's json_whitespace. A choice list, which upstream has no field
    for, goes as its EBNF grammar too."""
    kind = guided.kind
    if kind in (GuidedKind.JSON_SCHEMA, GuidedKind.JSON_OBJECT):
        return {"grammar": str(to_grammar(guided))}
    if kind is GuidedKind.REGEX:
        return {"regex": guided.spec}
    if kind is GuidedKind.CHOICE:
        return {"grammar": choice_ebnf(guided.choices)}
    return {"grammar": guided.spec}


def token_logprob(output: Any, position: int, token: int, k: int) -> TokenLogprob | None:
    """The logprob of output.token_ids[position] with up to k alternatives, if reported.

    Logprobs align with the end of token_ids: a generation-only request's leading context
    token may come without one (its logprob travels from the prefill worker instead)."""
    logprobs = output.logprobs or []
    index = position - (len(output.token_ids) - len(logprobs))
    if not 0 <= index < len(logprobs):
        return None
    entry = logprobs[index]
    if not isinstance(entry, dict):  # some versions report a bare float per token
        return TokenLogprob(token, float(entry))
    ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
    own = entry.get(token)
    value = float(own.logprob) if own is not None else float("-inf")
    top = tuple(TopLogprob(int(t), float(lp.logprob)) for t, lp in ranked[:k])
    return TokenLogprob(token, value, top)


def finish_reason(output: Any) -> FinishReason | TandemError:
    """A finished output's reason, or the error to fail its stream with."""
    reason = output.finish_reason
    if reason in _FINISH:
        return _FINISH[reason]
    if reason == "timeout":
        return DeadlineExceeded("TensorRT-LLM timed the request out")
    return Unavailable(f"TensorRT-LLM finished the request with no known reason ({reason!r})")
