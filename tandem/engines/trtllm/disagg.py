"""TensorRT-LLM's DisaggregatedParams inside Tandem's KV handle, and their request ids.

A context-only request returns DisaggregatedParams built from its ContextPhaseParams
(tensorrt_llm/executor/result.py: request_type, first_gen_tokens, ctx_request_id, opaque_state,
draft_tokens); the generation-only request on the decode worker passes them back with
request_type="generation_only" (tensorrt_llm/serve/openai_disagg_service.py
`_get_gen_request`), and both legs carry the same disagg_request_id, which TensorRT-LLM uses as
the underlying request id of each (tensorrt_llm/disaggregated_params.py).
"""
from __future__ import annotations

import secrets
from typing import Any

from tandem.engines.types import TrtllmParams

#: Global disagg request ids live in [2^40, 2^63), disjoint from TensorRT-LLM's local request
#: ids (tensorrt_llm/llmapi/disagg_utils.py MIN_GLOBAL_ID).
MIN_GLOBAL_ID = 1 << 40
MAX_GLOBAL_ID = (1 << 63) - 1


def new_disagg_request_id() -> int:
    """A random id in the global range. Upstream's snowflake ids need a node id per worker
    (get_global_disagg_request_id); 62 random bits need no coordination, and a collision
    matters only between two requests in flight on the same decode worker."""
    return MIN_GLOBAL_ID + secrets.randbelow(MAX_GLOBAL_ID - MIN_GLOBAL_ID + 1)


def context_only(api: Any, disagg_request_id: int) -> Any:
    return api.DisaggregatedParams(request_type="context_only",
                                   disagg_request_id=disagg_request_id)


def to_handle_params(params: Any, disagg_request_id: int) -> TrtllmParams:
    """The context response's DisaggregatedParams as they travel in the KV handle."""
    return TrtllmParams(
        opaque_state=bytes(params.opaque_state or b""),
        first_gen_tokens=tuple(int(t) for t in params.first_gen_tokens or ()),
        ctx_request_id=params.ctx_request_id,
        draft_tokens=tuple(int(t) for t in params.draft_tokens or ()),
        disagg_request_id=params.disagg_request_id or disagg_request_id)


def generation_only(api: Any, params: TrtllmParams) -> Any:
    """DisaggregatedParams for the decode worker's generation-only request."""
    return api.DisaggregatedParams(
        request_type="generation_only",
        first_gen_tokens=list(params.first_gen_tokens),
        ctx_request_id=params.ctx_request_id,
        opaque_state=params.opaque_state or None,
        draft_tokens=list(params.draft_tokens) or None,
        disagg_request_id=params.disagg_request_id)


def whole_request(api: Any) -> Any:
    """A request a prefill or decode worker runs whole, with no peer (as Dynamo's health
    check payload, components/src/dynamo/trtllm/health_check.py)."""
    return api.DisaggregatedParams(request_type="context_and_generation")
