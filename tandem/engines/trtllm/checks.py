"""Admission checks of the trtllm engine: what Tandem can tell before TensorRT-LLM sees a
request, with errors that name the field at fault."""
from __future__ import annotations

from tandem.engines.batching.validation import check_prompt_and_length, check_top_logprobs
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
    check_prompt_and_length(request, vocab_size, max_model_len)
    if sampling.prompt_logprobs is not None:
        raise InvalidRequest("the trtllm engine does not return prompt logprobs yet",
                             param="prompt_logprobs")
    check_top_logprobs("top_logprobs", sampling.top_logprobs)
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
