"""Engine arguments shared by every backend. Flag names follow Dynamo's TensorRT-LLM worker and
mocker where one exists."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineArgs:
    # == model and engine ==
    #: Model directory (config.json and tokenizer files; weights where the backend needs them);
    #: unset: the generated demo model.
    model: str = ""
    #: Reference engine: auto (CUDA when available), cpu, cuda or cuda:N.
    device: str = "auto"
    #: Reference engine: auto (the checkpoint's dtype on CUDA, float32 on CPU), float32, float16
    #: or bfloat16.
    dtype: str = "auto"
    #: Reference engine: auto reads the weights; dummy draws random ones of the same shape
    #: (performance work without a checkpoint).
    load_format: str = "auto"
    #: Reference engine: auto reads quantized checkpoints as their quantization_config says
    #: (FP8: compressed-tensors, fine-grained block FP8, ModelOpt; gpt-oss MXFP4); fp8 also
    #: quantizes a bf16 checkpoint's dense projections to FP8 per row while loading. FP8
    #: weights stay FP8 on GPUs of compute capability 8.9+, elsewhere they are dequantized.
    quantization: str = "auto"
    #: Reference engine: the KV cache's dtype: auto (the model's) or fp8 (e4m3 at the
    #: checkpoint's per-layer KV-cache scales, else 1.0: half the bytes of bf16 per block, so
    #: twice the blocks and half the attention reads; the host tier and KV transfers move the
    #: FP8 blocks as they are, and both sides of a transfer need the same dtype).
    kv_cache_dtype: str = "auto"
    #: Speculative decoding, a JSON object (vLLM's and TensorRT-LLM's spirit): method
    #: ngram (prompt lookup), draft_model (a small model of the same tokenizer) or eagle3
    #: (an EAGLE-3 head), num_speculative_tokens, the method's own settings
    #: (prompt_lookup_min/max; model) and disable_by_batch_size (no step speculates while
    #: more requests run; default 8, 0: never turned down). Empty: off. Greedy and seeded
    #: output is the same as without it. See docs/engines.md.
    speculative_config: str = ""
    #: Reference engine on CUDA: run decode steps eagerly instead of through CUDA graphs.
    enforce_eager: bool = False
    #: Reference engine on CUDA: run steps with prompt tokens eagerly instead of through
    #: piecewise CUDA graphs (each layer's work but its attention, steps of up to 512 tokens).
    disable_prefill_graphs: bool = False
    #: Seed for engine-chosen randomness (requests without a seed, dummy weights).
    seed: int = 0
    #: Grammar backend that enforces structured outputs (response_format, guided_*): xgrammar
    #: (every engine), llguidance (TensorRT-LLM only) or none (such requests are refused, and
    #: TensorRT-LLM skips loading the tokenizer).
    guided_decoding_backend: str = "xgrammar"
    # == batching and scheduling ==
    #: Most requests in one engine step.
    max_batch_size: int = 256
    #: Most tokens (prefill chunks + decode tokens) in one engine step. 4,096 (TensorRT-LLM's
    #: own default is 8,192): a prompt that arrives while a step runs waits for its end, and a
    #: shorter step keeps a burst that reaches the worker over tens of ms from splitting into
    #: late groups (8B on an H100, 64 streams of 200/200: served TTFT p50 1.11-1.50x the
    #: engine's own at 8,192, 0.76-1.11x at 4,096; 1000/200 x 64 in process 3,531-3,634 tok/s
    #: against 3,641; benchmarks/RESULTS.md, "Serving on the GPU, round 9").
    max_num_tokens: int = 4096
    #: Longest prompt + output, tokens; 0: the model's max_position_embeddings.
    max_seq_len: int = 0
    #: Most requests admitted but not yet running; past it new requests get RESOURCE_EXHAUSTED.
    max_queued_requests: int = 1024
    #: Milliseconds an engine with no request running holds new prompts for more to arrive
    #: (starting at once when they fill max_batch_size or max_num_tokens), so that a burst is
    #: prefilled in full steps; 0: off. TensorRT-LLM's batch_wait_timeout_ms. A lone request
    #: pays the whole wait: for bursty loads.
    batch_wait_timeout_ms: float = 0.0
    #: Reference engine and TensorRT-LLM: compute each decode step in full before scheduling
    #: the next, instead of launching the next while the device computes this one.
    disable_overlap_scheduler: bool = False
    # == KV cache ==
    #: Tokens per KV block (the router's and frontend's block size must match).
    kv_block_size: int = field(default=32, metadata={"flag": "--kv-block-size"})
    #: KV pool size in blocks; 0: derived (reference: from the memory budget below; mock:
    #: Dynamo's mocker default capacity, 1,048,576 tokens, i.e. 32768 blocks of 32).
    num_gpu_blocks: int = field(default=0, metadata={"flag": "--num-gpu-blocks-override"})
    #: Reference engine on CUDA: fraction (0-1) of the GPU memory free after loading the
    #: weights that the KV pool takes.
    free_gpu_memory_fraction: float = 0.9
    #: Reference engine on CUDA: the share (0-1] of its GPU's total memory this worker may hold
    #: (weights, KV pool, transfer buffer, activations), for workers that share a GPU: the KV
    #: pool then takes free_gpu_memory_fraction of what is left of that share after the
    #: weights, whatever the other worker holds at that moment. 0: the whole GPU.
    gpu_memory_fraction: float = 0.0
    #: Reference engine on CPU: bytes the KV pool takes.
    kv_cache_cpu_bytes: int = 512 * 1024 * 1024
    #: Reuse cached KV blocks across requests with the same prefix.
    enable_prefix_caching: bool = True
    #: Bytes of host memory (pinned on CUDA) for a second KV tier: blocks evicted from the KV
    #: pool are copied there and copied back on a prefix hit instead of recomputed; 0: off.
    #: TensorRT-LLM: kv_cache_config.host_cache_size.
    kv_host_cache_bytes: int = 0
    # == multimodal ==
    #: Reference engine, vision-language models: bytes of image embeddings kept by content hash
    #: so that a repeated image skips the vision encoder (0: no cache).
    encoder_cache_bytes: int = 256 * 1024 * 1024
    #: TensorRT-LLM: load only the multimodal encoder (MultimodalEncoder), for encode workers.
    encode_only: bool = False
    #: Load the model for embeddings only (an embedding worker, `tandem serve embed`): final
    #: hidden states pooled per input, no sampling, no KV cache kept between requests.
    embed_only: bool = False
    # == disaggregation ==
    #: Decode side: what to do when reading a prefill worker's KV fails or its lease expired:
    #: recompute (prefill locally) or fail (end the request with an error).
    kv_load_failure_policy: str = "recompute"
    #: Tokens of KV the transfer buffer holds (TensorRT-LLM's cache_transceiver_config
    #: max_tokens_in_buffer), on each side of a disaggregated pair: the prefill worker gathers a
    #: leased prompt's blocks into it, the decode worker reads them into its own with ONE NIXL
    #: descriptor and scatters them into its pool (scattered blocks otherwise cost a descriptor
    #: per block and layer, ~10 us each on NVLink). A prompt that does not fit goes block by
    #: block. 0: no buffer. Only workers that move KV allocate it.
    kv_transfer_buffer_tokens: int = 32768
    # == testing ==
    #: Record a checksum of every leased and every received KV transfer (Worker.Stats RPC);
    #: costs a pass over the bytes.
    debug_kv_checksums: bool = False
    # == mock engine ==
    #: Mock engine: divide simulated step times by this ratio; 0 or >= 1e6: no delay.
    speedup_ratio: float = 1.0
    #: Mock engine: simulated KV transfer bandwidth between workers, GB/s (0: instant).
    mock_kv_transfer_gbps: float = 25.0
    #: Mock engine: simulated copy bandwidth between the KV pool and the host tier
    #: (--kv-host-cache-bytes), GB/s; a step lasts its copies plus its compute (0: instant).
    mock_kv_host_gbps: float = 25.0
    # == parallelism ==
    #: Reference engine and TensorRT-LLM: GPUs (ranks) per tensor-parallel group, one worker.
    #: The reference engine starts a process per rank past the first (NCCL between GPUs, gloo
    #: on the CPU), each holding its shard of the weights and of the KV heads.
    tensor_parallel_size: int = 1
    # == TensorRT-LLM engine ==
    #: TensorRT-LLM: pipeline-parallel stages.
    pipeline_parallel_size: int = 1
    #: TensorRT-LLM: expert-parallel size of MoE weights (moe_expert_parallel_size); 0: unset.
    expert_parallel_size: int = 0
    #: TensorRT-LLM: attention data parallelism (DeepSeek-style MoE models).
    enable_attention_dp: bool = False
    #: TensorRT-LLM: most beams per request.
    max_beam_width: int = 1
    #: TensorRT-LLM: a YAML file of LLM API options, the file `trtllm-serve
    #: --extra_llm_api_options` takes; merged over the flags above, nested dicts deeply.
    extra_engine_args: str = ""
    #: TensorRT-LLM: a JSON object of LLM API options merged last (over the YAML file).
    override_engine_args: str = ""
