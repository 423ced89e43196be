"""Checks of the batching engine: the arguments it starts with (each failure names the flag),
and what a request must satisfy before it is queued (each failure names the field at fault)."""
from __future__ import annotations

from tandem.engines.args import EngineArgs
from tandem.engines.types import EngineRequest, KvLayout
from tandem.errors import FailedPrecondition, InvalidRequest
from tandem.kv.block_pool import BlockPool

#: Most alternatives per token a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


def check_prompt_and_length(request: EngineRequest, vocab_size: int, max_model_len: int) -> None:
    """The prompt is non-empty with ids in the vocabulary, and prompt plus max_tokens fit the
    model's context (every engine's first checks)."""
    prompt = request.prompt_token_ids
    sampling = request.sampling
    if not prompt:
        raise InvalidRequest("the prompt is empty; at least one token is required",
                             param="prompt_token_ids")
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequest(f"prompt token id {bad} at position {prompt.index(bad)} is "
                             f"outside the vocabulary [0, {vocab_size})",
                             param="prompt_token_ids")
    if sampling.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {sampling.max_tokens}",
                             param="max_tokens")
    if len(prompt) + sampling.max_tokens > max_model_len:
        raise InvalidRequest(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) is "
            f"{len(prompt) + sampling.max_tokens} tokens, beyond this model's maximum "
            f"context length of {max_model_len} tokens", param="max_tokens")


def check_top_logprobs(name: str, k: int | None) -> None:
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}",
                             param=name)


def check_prompt_and_sampling(request: EngineRequest, vocab_size: int, max_model_len: int,
                              pool: BlockPool) -> None:
    """check_prompt_and_length, and prompt plus max_tokens fit this worker's whole KV pool."""
    check_prompt_and_length(request, vocab_size, max_model_len)
    sampling = request.sampling
    needed = pool.blocks_for(len(request.prompt_token_ids) + sampling.max_tokens)
    if needed > pool.total:
        raise InvalidRequest(
            f"the prompt plus max_tokens needs {needed} KV blocks but this worker has only "
            f"{pool.total}", param="max_tokens")
    check_top_logprobs("top_logprobs", sampling.top_logprobs)
    check_top_logprobs("prompt_logprobs", sampling.prompt_logprobs)


def check_kv_handle(request: EngineRequest, layout: KvLayout, accepted_backends: frozenset[str],
                    engine_name: str, pool: BlockPool) -> None:
    """A decode request resuming from a prefill worker's KV: the handle's layout and transfer
    backend suit this engine, and it covers exactly the prompt."""
    handle = request.kv_handle
    assert handle is not None
    prompt = request.prompt_token_ids
    mismatch = layout.mismatch(handle.layout)
    if mismatch is not None:
        raise FailedPrecondition(mismatch, param="kv_handle")
    if handle.backend not in accepted_backends:
        raise FailedPrecondition(
            f"KV handle transfer backend '{handle.backend}' cannot be used by the "
            f"{engine_name} engine (accepted: {', '.join(sorted(accepted_backends))})",
            param="kv_handle")
    if request.first_token is None:
        raise InvalidRequest("a request with a KV handle must carry the prefill worker's "
                             "first token", param="first_token")
    if handle.num_tokens != len(prompt):
        raise FailedPrecondition(f"the KV handle covers {handle.num_tokens} tokens but the "
                                 f"prompt has {len(prompt)}", param="kv_handle")
    if len(handle.block_ids) != pool.blocks_for(len(prompt)):
        raise FailedPrecondition(
            f"the KV handle lists {len(handle.block_ids)} blocks but {len(prompt)} tokens "
            f"fill {pool.blocks_for(len(prompt))}", param="kv_handle")


def validate_args(args: EngineArgs) -> None:
    """Rejects batching arguments no engine can run with, naming the flag."""
    for name in ("kv_block_size", "max_batch_size", "max_num_tokens", "max_queued_requests"):
        if getattr(args, name) < 1:
            raise InvalidRequest(f"{name} must be at least 1, got {getattr(args, name)}",
                                 param=name)
    if args.kv_load_failure_policy not in ("recompute", "fail"):
        raise InvalidRequest("kv_load_failure_policy must be recompute or fail, got "
                             f"'{args.kv_load_failure_policy}'", param="kv_load_failure_policy")
    if args.num_gpu_blocks < 0:
        raise InvalidRequest(f"num_gpu_blocks must be >= 0, got {args.num_gpu_blocks}",
                             param="num_gpu_blocks")
    if not args.batch_wait_timeout_ms >= 0:  # NaN too
        raise InvalidRequest(f"batch_wait_timeout_ms must be >= 0, got "
                             f"{args.batch_wait_timeout_ms}", param="batch_wait_timeout_ms")
    if args.kv_host_cache_bytes < 0:
        raise InvalidRequest(f"kv_host_cache_bytes must be >= 0, got {args.kv_host_cache_bytes}",
                             param="kv_host_cache_bytes")
    if args.kv_host_cache_bytes and not args.enable_prefix_caching:
        raise InvalidRequest("--kv-host-cache-bytes needs prefix caching (the host tier holds "
                             "cached prefixes by hash)", param="kv_host_cache_bytes")
    if args.guided_decoding_backend not in ("xgrammar", "none"):
        raise InvalidRequest("guided_decoding_backend must be xgrammar or none for this engine, "
                             f"got '{args.guided_decoding_backend}'",
                             param="guided_decoding_backend")


def num_host_blocks(args: EngineArgs, layout: KvLayout) -> int:
    """Host-tier slots --kv-host-cache-bytes holds (0: no host tier)."""
    if not args.kv_host_cache_bytes:
        return 0
    slots = args.kv_host_cache_bytes // layout.block_bytes
    if slots < 1:
        raise InvalidRequest(f"--kv-host-cache-bytes {args.kv_host_cache_bytes} holds no block of "
                             f"{layout.block_bytes} bytes", param="kv_host_cache_bytes")
    return slots
