"""Fake of tensorrt_llm/llmapi/llm_args.py (NVIDIA/TensorRT-LLM, the 2025-26 versions whose
config classes derive from StrictBaseModel, i.e. pydantic `extra="forbid"`).

Field names, types and defaults are upstream's for the configs Tandem sets or documents
(KvCacheConfig, CacheTransceiverConfig, CudaGraphConfig, SchedulerConfig, MoeConfig) and for the
TorchLlmArgs fields listed; upstream has more TorchLlmArgs fields (LoRA, speculative decoding,
quantization, ...), which the fake does not know and therefore rejects. Validators that need a
GPU are left out.
"""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt


class StrictBaseModel(BaseModel):
    """Upstream: `class Config: extra = "forbid"` (llm_args.py), later moved to llmapi/utils."""

    model_config = ConfigDict(extra="forbid")


class CudaGraphConfig(StrictBaseModel):
    batch_sizes: list[int] | None = None
    max_batch_size: NonNegativeInt = 0
    enable_padding: bool = False


class DynamicBatchConfig(StrictBaseModel):
    enable_batch_size_tuning: bool = True
    enable_max_num_tokens_tuning: bool = False
    dynamic_batch_moving_average_window: int = 128


class SchedulerConfig(StrictBaseModel):
    capacity_scheduler_policy: Literal["MAX_UTILIZATION", "GUARANTEED_NO_EVICT",
                                       "STATIC_BATCH"] = "GUARANTEED_NO_EVICT"
    context_chunking_policy: Literal["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"] | None = None
    dynamic_batch_config: DynamicBatchConfig | None = None
    waiting_queue_policy: Literal["fcfs"] = "fcfs"


class KvCacheConfig(StrictBaseModel):
    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[PositiveInt] | None = Field(default=None, min_length=1)
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = Field(default=0.9, ge=0, le=1)
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    cross_kv_cache_fraction: float | None = None
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int = 0
    attention_dp_events_gather_period_ms: int = 5
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False
    max_gpu_total_bytes: NonNegativeInt = 0
    dtype: str = "auto"
    mamba_ssm_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    tokens_per_block: int = 32


class CacheTransceiverConfig(StrictBaseModel):
    backend: Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"] | None = None
    transceiver_runtime: Literal["CPP", "PYTHON"] | None = None
    max_tokens_in_buffer: int | None = None
    kv_transfer_timeout_ms: PositiveInt | None = None
    kv_transfer_sender_future_timeout_ms: PositiveInt | None = 1000


class MoeConfig(StrictBaseModel):
    backend: Literal["CUTLASS", "CUTEDSL", "WIDEEP", "TRTLLM", "DEEPGEMM", "VANILLA"] = "CUTLASS"
    max_num_tokens: int | None = None
    load_balancer: object | str | None = None


class LoadFormat(Enum):
    AUTO = 0
    DUMMY = 1
    VISION_ONLY = 2


class TorchLlmArgs(StrictBaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    model: str | Path
    tokenizer: Any = None
    tokenizer_mode: Literal["auto", "slow"] = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    gpus_per_node: int | None = None
    moe_cluster_parallel_size: int | None = None
    moe_tensor_parallel_size: int | None = None
    moe_expert_parallel_size: int | None = None
    enable_attention_dp: bool = False
    load_format: str | LoadFormat = LoadFormat.AUTO
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    enable_chunked_prefill: bool = False
    guided_decoding_backend: Literal["xgrammar", "llguidance"] | None = None
    iter_stats_max_iterations: int | None = None
    request_stats_max_iterations: int | None = None
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cache_transceiver_config: CacheTransceiverConfig | None = None
    max_batch_size: int | None = 2048
    max_input_len: int | None = 1024
    max_seq_len: int | None = None
    max_beam_width: int | None = 1
    max_num_tokens: int | None = 8192
    gather_generation_logits: bool = False
    num_postprocess_workers: int = 0
    postprocess_tokenizer_dir: str | None = None
    reasoning_parser: str | None = None
    return_perf_metrics: bool = False
    orchestrator_type: Literal["rpc", "ray"] | None = None
    garbage_collection_gen0_threshold: int = 20000
    cuda_graph_config: CudaGraphConfig | None = Field(default_factory=CudaGraphConfig)
    disable_overlap_scheduler: bool = False
    batch_wait_timeout_ms: float = 0
    moe_config: MoeConfig = Field(default_factory=MoeConfig)
    attn_backend: str = "TRTLLM"
    sampler_type: str = "auto"
    enable_iter_perf_stats: bool = False
    enable_iter_req_stats: bool = False
    print_iter_log: bool = False
    enable_autotuner: bool = True
    stream_interval: PositiveInt = 1
    enable_min_latency: bool = False
    checkpoint_format: str | None = None
    mm_encoder_only: bool = False
    enable_sleep: bool = False
    max_stats_len: int = 1000
    backend: Literal["pytorch"] = "pytorch"


LlmArgs = TorchLlmArgs
