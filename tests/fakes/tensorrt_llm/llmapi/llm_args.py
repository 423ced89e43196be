"""Fake of tensorrt_llm/llmapi/llm_args.py (NVIDIA/TensorRT-LLM, the 2025-26 versions whose
config classes derive from StrictBaseModel, i.e. pydantic `extra="forbid"`).

Field names, types and defaults are upstream's for the configs Tandem sets or documents
(KvCacheConfig, CacheTransceiverConfig, CudaGraphConfig, SchedulerConfig, MoeConfig, and the
speculative decoding configs below) and for the TorchLlmArgs fields listed; upstream has more
TorchLlmArgs fields (LoRA, quantization, ...), which the fake does not know and therefore rejects.
Validators that need a GPU are left out.

Speculative decoding: DecodingBaseConfig, EagleDecodingConfig, Eagle3DecodingConfig,
NGramDecodingConfig, DraftTargetDecodingConfig and the `SpeculativeConfig` union discriminated by
`decoding_type`, as at NVIDIA/TensorRT-LLM 0004396720054fd8e205cbf616f21f0b57c6b412. Upstream's
union has more members (MTP, SA, UserProvided, SaveState, PARD, DFlash, DSpark, AUTO), which the
fake rejects as unknown `decoding_type`s; of DecodingBaseConfig's fields the fake keeps those
listed, and it does not translate `max_concurrency` into a `draft_len_schedule` (upstream does
for the modes that support a dynamic draft length). Eagle trees (eagle_choices,
use_dynamic_tree) are not modelled: the fake takes the linear chain only.
"""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    field_validator,
    model_validator,
)


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


class DecodingBaseConfig(StrictBaseModel):
    max_draft_len: NonNegativeInt | None = None
    max_total_draft_tokens: int | None = None
    speculative_model: str | Path | None = Field(
        default=None,
        validation_alias=AliasChoices("speculative_model", "speculative_model_dir"))
    max_concurrency: PositiveInt | None = None
    draft_len_schedule: dict[int, int] | None = None
    load_format: str | None = None
    acceptance_rate_window_size: NonNegativeInt | None = None
    acceptance_rate_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    use_rejection_sampling: bool = False
    enable_penalty: bool = False

    @field_validator("draft_len_schedule")
    @classmethod
    def validate_draft_len_schedule_and_sort(cls, v: dict[int, int] | None,
                                             info: Any) -> dict[int, int] | None:
        if v is None:
            return v
        for batch_size, draft_len in v.items():
            if batch_size < 1:
                raise ValueError("draft_len_schedule: batch size threshold must be >= 1, "
                                 f"got {batch_size}")
            if draft_len < 0:
                raise ValueError(f"draft_len_schedule: draft length must be >= 0, got {draft_len}")
        max_draft_len = info.data.get("max_draft_len")
        smallest = min(v)
        if max_draft_len is not None and v[smallest] != max_draft_len:
            raise ValueError(f"draft_len_schedule[{smallest}] must equal max_draft_len")
        return dict(sorted(v.items()))

    @model_validator(mode="after")
    def validate_max_concurrency_and_draft_len_schedule_mutually_exclusive(
            self) -> DecodingBaseConfig:
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive. "
                             "Use max_concurrency for a simple speculation cutoff, or "
                             "draft_len_schedule for dynamic draft-length control.")
        return self


class EagleDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["Eagle"] = "Eagle"
    greedy_sampling: bool | None = True
    posterior_threshold: float | None = None
    num_eagle_layers: int | None = None
    max_non_leaves_per_layer: int | None = None
    eagle3_one_model: bool | None = True
    eagle3_layers_to_capture: set[int] | None = None
    eagle3_model_arch: Literal["llama3", "mistral_large3"] = "llama3"

    @model_validator(mode="after")
    def validate_eagle_config(self) -> EagleDecodingConfig:
        if self.max_draft_len is None or self.max_draft_len == 0:
            raise ValueError("max_draft_len must be > 0 for Eagle")
        # Upstream: eagle3_one_model=False is deprecated, ignored and set back to True.
        self.eagle3_one_model = True
        self.num_eagle_layers = self.max_draft_len
        if self.max_total_draft_tokens is None:
            self.max_total_draft_tokens = self.max_draft_len
        return self

    @model_validator(mode="after")
    def validate_speculative_model(self) -> EagleDecodingConfig:
        if self.speculative_model is None:
            raise ValueError("Draft model must be provided for EAGLE")
        return self


class Eagle3DecodingConfig(EagleDecodingConfig):
    decoding_type: Literal["Eagle3"] = "Eagle3"  # type: ignore[assignment]


class NGramDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["NGram"] = "NGram"
    max_matching_ngram_size: PositiveInt = 2
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    @model_validator(mode="after")
    def validate_ngram_config(self) -> NGramDecodingConfig:
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for NGram")
        self.max_total_draft_tokens = self.max_draft_len
        return self


class DraftTargetDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["Draft_Target"] = "Draft_Target"

    @model_validator(mode="after")
    def validate_draft_target_config(self) -> DraftTargetDecodingConfig:
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for DraftTarget")
        if self.speculative_model is None:
            raise ValueError("speculative_model must be specified for DraftTarget")
        self.max_total_draft_tokens = self.max_draft_len
        return self


SpeculativeConfig = Annotated[
    DraftTargetDecodingConfig
    | Eagle3DecodingConfig  # before EagleDecodingConfig, its base (as upstream)
    | EagleDecodingConfig
    | NGramDecodingConfig,
    Field(discriminator="decoding_type"),
]


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
    speculative_config: SpeculativeConfig | None = None
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
