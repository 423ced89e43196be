"""Fake of tensorrt_llm/llmapi/__init__.py (the names Tandem imports)."""
from __future__ import annotations

from tensorrt_llm.disaggregated_params import DisaggregatedParams
from tensorrt_llm.executor import CompletionOutput, RequestError
from tensorrt_llm.llmapi.llm import LLM, RequestOutput
from tensorrt_llm.llmapi.llm_args import (
    CacheTransceiverConfig,
    CudaGraphConfig,
    KvCacheConfig,
    SchedulerConfig,
    TorchLlmArgs,
)
from tensorrt_llm.llmapi.mm_encoder import MultimodalEncoder
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = ["LLM", "MultimodalEncoder", "CompletionOutput", "RequestOutput", "RequestError",
           "SamplingParams", "DisaggregatedParams", "KvCacheConfig", "CacheTransceiverConfig",
           "CudaGraphConfig", "SchedulerConfig", "TorchLlmArgs", "GuidedDecodingParams"]
