"""A finished context-only request as Tandem's PrefillResult.

TensorRT-LLM sends a context request's KV only when it finished by length (max_tokens is forced
to 1 for context-only requests: tensorrt_llm/llmapi/llm.py generate_async; the send condition:
tensorrt_llm/_torch/pyexecutor/py_executor.py `_send_disagg_ctx_cache`), and its disaggregated
server skips the generation leg for any other finish reason (tensorrt_llm/serve/
openai_disagg_service.py `_need_gen`). So: "length" gives a KV handle, "stop" (EOS on the first
token) gives the finished answer and no handle. A request of max_tokens 1 needs no decode
leg at all; the engine runs it whole (disagg_id None) and it ends here too.
"""
from __future__ import annotations

import time
from typing import Any

from tandem.engines.trtllm import disagg
from tandem.engines.trtllm.sampling import finish_reason, token_logprob
from tandem.engines.types import (
    EngineRequest,
    FinishReason,
    KvHandle,
    KvLayout,
    PrefillResult,
    TokenLogprob,
)
from tandem.errors import Cancelled, TandemError, Unavailable
from tandem.kv.hashing import block_hashes


def prefill_result(result: Any, request: EngineRequest, layout: KvLayout,
                   disagg_id: int | None, transfer_timeout_ms: int | None) -> PrefillResult:
    """`disagg_id`: the context-only request's disagg_request_id; None for a whole request."""
    rid = request.request_id
    output = result.outputs[0]
    reason = finish_reason(output)
    if reason is FinishReason.CANCELLED:
        raise Cancelled(f"prefill of '{rid}' was cancelled")
    if isinstance(reason, TandemError):
        raise reason
    if not output.token_ids:
        raise Unavailable(f"TensorRT-LLM prefilled '{rid}' without producing a token")
    token = int(output.token_ids[0])
    k = request.sampling.top_logprobs
    first = (token_logprob(output, 0, token, k) if k is not None else None) \
        or TokenLogprob(token, 0.0)
    if reason is FinishReason.STOP or disagg_id is None:
        return PrefillResult(first, None, 0, reason)
    params = result.disaggregated_params
    if params is None or not params.first_gen_tokens:
        raise Unavailable(f"TensorRT-LLM returned no disaggregated params for the context-only "
                          f"request '{rid}'")
    prompt = request.prompt_token_ids
    expiry = int(time.time() * 1000) + transfer_timeout_ms if transfer_timeout_ms else 0
    handle = KvHandle(
        worker_id="", worker_address="", request_id=rid, backend="trtllm", layout=layout,
        num_tokens=len(prompt), block_hashes=tuple(block_hashes(prompt, layout.block_size)),
        lease_expiry_unix_ms=expiry, trtllm_params=disagg.to_handle_params(params, disagg_id))
    return PrefillResult(first, handle, 0)
