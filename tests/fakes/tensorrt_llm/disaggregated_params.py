"""Fake of tensorrt_llm/disaggregated_params.py (NVIDIA/TensorRT-LLM @ 01009a33).

Same dataclass (slots, kw_only), same fields and the same request_type validation in
__post_init__; the C++ conversions (get_context_phase_params, get_request_type) are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

_REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")


class DisaggScheduleStyle(IntEnum):
    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: str | None = None
    # P-D disaggregated params
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list | None = None
    first_gen_logits: list | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: DisaggScheduleStyle | None = None
    # E-P disaggregated params
    multimodal_embedding_handles: list[dict[str, Any]] | None = None
    multimodal_hashes: list[list[int]] | None = None
    mrope_position_ids_handle: dict[str, Any] | None = None
    mrope_position_deltas_handle: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.request_type is not None:
            self.request_type = self.request_type.lower()
            if self.request_type not in _REQUEST_TYPES:
                raise ValueError(
                    f"Unknown request type: {self.request_type}. Must be context_only, "
                    "generation_only or context_and_generation")
