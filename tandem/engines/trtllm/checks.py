"""Admission checks of the trtllm engine: what Tandem can tell before TensorRT-LLM sees a
request, with errors that name the field at fault."""
from __future__ import annotations

from tandem.engines.trtllm.sampling import MAX_TOP_LOGPROBS
from tandem.engines.types import EngineRequest, KvLayout
from tandem.errors import FailedPrecondition, InvalidRequest


def check_request(request: EngineRequest, layout: KvLayout, max_model_len: int,
                  vocab_size: int, guided_backend: str = "xgrammar") -> None:
    """Raises InvalidRequest / FailedPrecondition (see Engine.add_request)."""
    prompt, sampling = request.prompt_token_ids, request.sampling
    guided = sampling.guided
    if guided is not None and guided_backend == "none":
        raise FailedPrecondition("guided decoding is off on this worker "
                                 "(--guided-decoding-backend none)",
                                 param="sampling.guided_decoding")
    if guided is not None and guided.num_output_tokens_in_prompt:
        # TensorRT-LLM's guided decoder starts its grammar at the first generated token and
        # takes no tokens to advance it over first.
        raise FailedPrecondition("the trtllm engine cannot continue a guided request whose "
                                 "prompt ends with output already generated (a migrated "
                                 "request)", param="sampling.guided_decoding."
                                 "num_output_tokens_in_prompt")
    if not prompt:
        raise InvalidRequest("the prompt is empty; at least one token is required",
                             param="prompt_token_ids")
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequest(f"prompt token id {bad} at position {prompt.index(bad)} is outside "
                             f"the vocabulary [0, {vocab_size})", param="prompt_token_ids")
    if sampling.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {sampling.max_tokens}",
                             param="max_tokens")
    if len(prompt) + sampling.max_tokens > max_model_len:
        raise InvalidRequest(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) is "
            f"{len(prompt) + sampling.max_tokens} tokens, beyond this model's maximum context "
            f"length of {max_model_len} tokens", param="max_tokens")
    if sampling.prompt_logprobs is not None:
        raise InvalidRequest("the trtllm engine does not return prompt logprobs yet",
                             param="prompt_logprobs")
    k = sampling.top_logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}",
                             param="top_logprobs")
    handle = request.kv_handle
    if handle is None:
        return
    if handle.backend != "trtllm" or handle.trtllm_params is None:
        raise FailedPrecondition(
            f"KV handle transfer backend '{handle.backend}' cannot be used by the trtllm engine "
            "(it resumes only from TensorRT-LLM's own DisaggregatedParams, backend 'trtllm')",
            param="kv_handle")
    mismatch = layout.mismatch(handle.layout)
    if mismatch is not None:
        raise FailedPrecondition(mismatch, param="kv_handle")
    if request.first_token is None:
        raise InvalidRequest("a request with a KV handle must carry the prefill worker's first "
                             "token", param="first_token")
    if handle.num_tokens != len(prompt):
        raise FailedPrecondition(f"the KV handle covers {handle.num_tokens} tokens but the prompt "
                                 f"has {len(prompt)}", param="kv_handle")
