"""Protobuf <-> domain conversions, so that servicers stay translation layers and the library
never sees protobuf."""
from __future__ import annotations

from collections.abc import Sequence

from tandem.engines import types as t
from tandem.engines.guided.grammar import MAX_JSON_WHITESPACE
from tandem.errors import InvalidRequest
from tandem.runtime.devices import Device
from tandem.runtime.served import ServedStats
from tandem.v1 import common_pb2 as pb
from tandem.v1 import kv_events_pb2 as ev_pb

_FINISH_TO_PB: dict[t.FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    t.FinishReason.STOP: pb.FINISH_REASON_STOP,
    t.FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    t.FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
_FINISH_FROM_PB: dict[pb.FinishReason, t.FinishReason | None] = {v: k for k, v in _FINISH_TO_PB.items()}
_BACKEND_TO_PB: dict[str, pb.TransferBackend] = {"nixl": pb.TRANSFER_BACKEND_NIXL, "trtllm": pb.TRANSFER_BACKEND_TRTLLM,
                  "mock": pb.TRANSFER_BACKEND_MOCK}
_BACKEND_FROM_PB: dict[pb.TransferBackend, str] = {v: k for k, v in _BACKEND_TO_PB.items()}


def sampling_from_pb(msg: pb.SamplingParams, default_max_tokens: int) -> t.SamplingParams:
    """Domain sampling params; absent optional fields take their documented defaults."""
    has = msg.HasField
    max_tokens = msg.max_tokens if has("max_tokens") else default_max_tokens
    if max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    return t.SamplingParams(
        max_tokens=max_tokens,
        temperature=msg.temperature if has("temperature") else 1.0,
        top_p=msg.top_p if has("top_p") else 1.0,
        top_k=msg.top_k if has("top_k") else 0,
        min_p=msg.min_p if has("min_p") else 0.0,
        seed=msg.seed if has("seed") else None,
        repetition_penalty=msg.repetition_penalty if has("repetition_penalty") else 1.0,
        frequency_penalty=msg.frequency_penalty if has("frequency_penalty") else 0.0,
        presence_penalty=msg.presence_penalty if has("presence_penalty") else 0.0,
        stop_token_ids=tuple(msg.stop_token_ids),
        min_tokens=msg.min_tokens,
        ignore_eos=msg.ignore_eos,
        top_logprobs=msg.top_logprobs if has("top_logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if has("prompt_logprobs") else None,
        guided=guided_from_pb(msg.guided_decoding) if has("guided_decoding") else None,
        speculative=not msg.disable_speculation,
    )


def guided_from_pb(msg: pb.GuidedDecoding) -> t.GuidedDecoding:
    """The domain constraint; a message without one, or with an empty one, is refused."""
    which = msg.WhichOneof("constraint")
    param = f"guided_decoding.{which}" if which else "guided_decoding"
    if which is None:
        raise InvalidRequest("guided_decoding sets no constraint", param=param)
    kind = t.GuidedKind(which)
    spec, choices = "", ()
    if kind is t.GuidedKind.CHOICE:
        choices = tuple(msg.choice.choices)
        if not choices:
            raise InvalidRequest("guided_decoding.choice needs at least one string", param=param)
    elif kind is t.GuidedKind.JSON_OBJECT:
        if not msg.json_object:
            raise InvalidRequest("guided_decoding.json_object must be true when set", param=param)
    else:
        spec = getattr(msg, which)
        if not spec:
            raise InvalidRequest(f"guided_decoding.{which} must not be empty", param=param)
    if msg.json_whitespace > MAX_JSON_WHITESPACE:
        raise InvalidRequest(f"guided_decoding.json_whitespace must be at most "
                             f"{MAX_JSON_WHITESPACE}, got {msg.json_whitespace}",
                             param="guided_decoding.json_whitespace")
    return t.GuidedDecoding(kind, spec, choices, msg.num_output_tokens_in_prompt,
                            msg.json_whitespace)


def guided_to_pb(guided: t.GuidedDecoding) -> pb.GuidedDecoding:
    msg = pb.GuidedDecoding(num_output_tokens_in_prompt=guided.num_output_tokens_in_prompt,
                            json_whitespace=guided.json_whitespace)
    kind = guided.kind
    if kind is t.GuidedKind.CHOICE:
        msg.choice.choices.extend(guided.choices)
    elif kind is t.GuidedKind.JSON_OBJECT:
        msg.json_object = True
    else:
        setattr(msg, kind.value, guided.spec)
    return msg


def sampling_to_pb(params: t.SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        stop_token_ids=params.stop_token_ids, min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos, disable_speculation=not params.speculative)
    if params.seed is not None:
        msg.seed = params.seed
    if params.top_logprobs is not None:
        msg.top_logprobs = params.top_logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.guided is not None:
        msg.guided_decoding.CopyFrom(guided_to_pb(params.guided))
    return msg


def finish_to_pb(reason: t.FinishReason | None) -> pb.FinishReason:
    return _FINISH_TO_PB[reason]


def finish_from_pb(value: pb.FinishReason) -> t.FinishReason | None:
    return _FINISH_FROM_PB.get(value)


def logprob_to_pb(lp: t.TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=a.token_id, logprob=a.logprob)
                                for a in lp.top])


def logprob_from_pb(msg: pb.TokenLogprob) -> t.TokenLogprob:
    return t.TokenLogprob(msg.token_id, msg.logprob,
                          tuple(t.TopLogprob(a.token_id, a.logprob) for a in msg.top))


def usage_to_pb(usage: t.Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens,
                    accepted_prediction_tokens=usage.accepted_prediction_tokens,
                    rejected_prediction_tokens=usage.rejected_prediction_tokens)


def usage_from_pb(msg: pb.Usage) -> t.Usage:
    return t.Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens,
                   msg.accepted_prediction_tokens, msg.rejected_prediction_tokens)


def layout_from_pb(msg: pb.KvLayout) -> t.KvLayout:
    return t.KvLayout(msg.dtype, msg.num_layers, msg.num_kv_heads, msg.head_size, msg.block_size,
                      max(msg.tensor_parallel_size, 1))


def layout_to_pb(layout: t.KvLayout) -> pb.KvLayout:
    return pb.KvLayout(dtype=layout.dtype, num_layers=layout.num_layers,
                       num_kv_heads=layout.num_kv_heads, head_size=layout.head_size,
                       block_size=layout.block_size,
                       tensor_parallel_size=layout.tensor_parallel_size)


def kv_handle_from_pb(msg: pb.KvHandle) -> t.KvHandle:
    trtllm = None
    if msg.HasField("trtllm_params"):
        p = msg.trtllm_params
        trtllm = t.TrtllmParams(
            opaque_state=p.opaque_state, first_gen_tokens=tuple(p.first_gen_tokens),
            ctx_request_id=p.ctx_request_id if p.HasField("ctx_request_id") else None,
            draft_tokens=tuple(p.draft_tokens),
            disagg_request_id=p.disagg_request_id if p.HasField("disagg_request_id") else None)
    return t.KvHandle(
        worker_id=msg.worker_id, worker_address=msg.worker_address, request_id=msg.request_id,
        backend=_BACKEND_FROM_PB.get(msg.backend, "unspecified"),
        layout=layout_from_pb(msg.layout), num_tokens=msg.num_tokens,
        block_ids=tuple(msg.block_ids), block_hashes=tuple(msg.block_hashes),
        nixl_agent_name=msg.nixl_agent_name, nixl_agent_metadata=msg.nixl_agent_metadata,
        descriptors=_descriptors_from_pb(msg.descriptors),
        nixl_memory_type=msg.nixl_memory_type, lease_expiry_unix_ms=msg.lease_expiry_unix_ms,
        trtllm_params=trtllm,
        ranks=tuple(t.RankSource(r.nixl_agent_name, r.nixl_agent_metadata,
                                 _descriptors_from_pb(r.descriptors)) for r in msg.ranks))


def _descriptors_from_pb(msgs: Sequence[pb.MemoryDescriptor]) -> tuple[t.MemoryDescriptor, ...]:
    return tuple(t.MemoryDescriptor(d.address, d.length, d.device_id) for d in msgs)


def _descriptors_to_pb(descriptors: Sequence[t.MemoryDescriptor]) -> list[pb.MemoryDescriptor]:
    return [pb.MemoryDescriptor(address=d.address, length=d.length, device_id=d.device_id)
            for d in descriptors]


def embedding_from_pb(msg: pb.MultimodalEmbedding) -> t.Embedding:
    if msg.WhichOneof("data") == "nixl":
        n = msg.nixl
        data: bytes | t.NixlTensorRef = t.NixlTensorRef(
            n.agent_name, n.agent_metadata,
            t.MemoryDescriptor(n.descriptor.address, n.descriptor.length, n.descriptor.device_id),
            n.memory_type)
    else:
        data = msg.raw
    return t.Embedding(msg.content_hash, tuple(msg.shape), msg.dtype, data,
                       msg.placeholder_offset)


def embedding_to_pb(item: t.Embedding) -> pb.MultimodalEmbedding:
    msg = pb.MultimodalEmbedding(content_hash=item.content_hash, shape=item.shape,
                                 dtype=item.dtype, placeholder_offset=item.placeholder_offset)
    if isinstance(item.data, t.NixlTensorRef):
        ref = item.data
        msg.nixl.CopyFrom(pb.NixlTensorRef(
            agent_name=ref.agent_name, agent_metadata=ref.agent_metadata,
            descriptor=pb.MemoryDescriptor(address=ref.descriptor.address,
                                           length=ref.descriptor.length,
                                           device_id=ref.descriptor.device_id),
            memory_type=ref.memory_type))
    else:
        msg.raw = item.data
    return msg


_TIER_TO_PB = {t.KvTier.DEVICE: ev_pb.KV_TIER_DEVICE, t.KvTier.HOST: ev_pb.KV_TIER_HOST}


def _tier_from_pb(value: int) -> t.KvTier:
    # Unspecified (an older worker) and any value this build does not know read as device.
    return t.KvTier.HOST if value == ev_pb.KV_TIER_HOST else t.KvTier.DEVICE


def stored_to_pb(event: t.BlockStored) -> ev_pb.BlockStored:
    msg = ev_pb.BlockStored(block_hashes=event.block_hashes, token_ids=event.token_ids,
                            block_size=event.block_size, mm_hashes=event.mm_hashes,
                            tier=_TIER_TO_PB[event.tier])
    if event.parent_hash is not None:
        msg.parent_hash = event.parent_hash
    return msg


def kv_event_to_pb(event: t.KvEvent) -> ev_pb.KvEvent:
    if isinstance(event, t.BlockStored):
        return ev_pb.KvEvent(stored=stored_to_pb(event))
    if isinstance(event, t.BlockRemoved):
        return ev_pb.KvEvent(removed=ev_pb.BlockRemoved(block_hashes=event.block_hashes,
                                                        tier=_TIER_TO_PB[event.tier]))
    return ev_pb.KvEvent(cleared=ev_pb.AllBlocksCleared())


def load_to_pb(worker_id: str, stats: t.EngineStats, now_ms: int,
               served: ServedStats | None = None,
               devices: Sequence[ev_pb.WorkerDevice] = ()) -> ev_pb.WorkerLoad:
    """`devices` as `devices_to_pb` made them (once: they do not change)."""
    msg = ev_pb.WorkerLoad(
        worker_id=worker_id, num_running=stats.num_running, num_waiting=stats.num_waiting,
        kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total,
        pending_prefill_tokens=stats.pending_prefill_tokens,
        active_decode_blocks=stats.active_decode_blocks,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate, timestamp_unix_ms=now_ms,
        devices=devices)
    if served is not None:
        msg.served.CopyFrom(served_to_pb(served))
    return msg


_SERVED_FIELDS = tuple(ServedStats.__slots__)


def served_to_pb(served: ServedStats) -> ev_pb.WorkerServed:
    return ev_pb.WorkerServed(**{f: getattr(served, f) for f in _SERVED_FIELDS})


def served_from_pb(msg: ev_pb.WorkerServed) -> ServedStats:
    return ServedStats(**{f: getattr(msg, f) for f in _SERVED_FIELDS})


def devices_to_pb(devices: Sequence[Device]) -> list[ev_pb.WorkerDevice]:
    return [ev_pb.WorkerDevice(id=d.id, name=d.name) for d in devices]


def devices_from_pb(msgs: Sequence[ev_pb.WorkerDevice]) -> tuple[Device, ...]:
    return tuple(Device(d.id, d.name) for d in msgs)


def kv_handle_to_pb(handle: t.KvHandle) -> pb.KvHandle:
    msg = pb.KvHandle(
        worker_id=handle.worker_id, worker_address=handle.worker_address,
        request_id=handle.request_id, backend=_BACKEND_TO_PB.get(handle.backend, pb.TRANSFER_BACKEND_UNSPECIFIED),
        layout=layout_to_pb(handle.layout), num_tokens=handle.num_tokens,
        block_ids=handle.block_ids, block_hashes=handle.block_hashes,
        nixl_agent_name=handle.nixl_agent_name, nixl_agent_metadata=handle.nixl_agent_metadata,
        descriptors=_descriptors_to_pb(handle.descriptors),
        nixl_memory_type=handle.nixl_memory_type,
        lease_expiry_unix_ms=handle.lease_expiry_unix_ms,
        ranks=[pb.KvRankSource(nixl_agent_name=r.nixl_agent_name,
                               nixl_agent_metadata=r.nixl_agent_metadata,
                               descriptors=_descriptors_to_pb(r.descriptors))
               for r in handle.ranks])
    if handle.trtllm_params is not None:
        p = handle.trtllm_params
        params = pb.TrtllmDisaggParams(opaque_state=p.opaque_state,
                                       first_gen_tokens=p.first_gen_tokens,
                                       draft_tokens=p.draft_tokens)
        if p.ctx_request_id is not None:
            params.ctx_request_id = p.ctx_request_id
        if p.disagg_request_id is not None:
            params.disagg_request_id = p.disagg_request_id
        msg.trtllm_params.CopyFrom(params)
    return msg


def stored_from_pb(msg: ev_pb.BlockStored) -> t.BlockStored:
    return t.BlockStored(tuple(msg.block_hashes),
                         msg.parent_hash if msg.HasField("parent_hash") else None,
                         tuple(msg.token_ids), msg.block_size, tuple(msg.mm_hashes),
                         _tier_from_pb(msg.tier))


def kv_event_from_pb(msg: ev_pb.KvEvent) -> t.KvEvent:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        return stored_from_pb(msg.stored)
    if kind == "removed":
        return t.BlockRemoved(tuple(msg.removed.block_hashes),
                              _tier_from_pb(msg.removed.tier))
    return t.AllBlocksCleared()
