"""Domain types that cross the engine interface. Services convert protobuf to and from these
(tandem.runtime.convert); engines never see protobuf."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class GuidedKind(enum.Enum):
    """The kinds of GuidedDecoding constraint (the oneof of GuidedDecoding in common.proto)."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """A constraint on the output (structured outputs; see GuidedDecoding in common.proto).

    Immutable and hashable: `grammar_key` identifies the compiled grammar, so engines cache
    grammars by it.
    """

    kind: GuidedKind
    #: JSON_SCHEMA: the schema as JSON text; REGEX: the pattern; GRAMMAR: the EBNF text;
    #: JSON_OBJECT and CHOICE: "".
    spec: str = ""
    #: CHOICE: the allowed outputs, in the client's order.
    choices: tuple[str, ...] = ()
    #: Trailing prompt tokens that are output already generated under this constraint (a
    #: migrated request); the engine advances the grammar over them first.
    num_output_tokens_in_prompt: int = 0
    #: JSON_SCHEMA and JSON_OBJECT: most whitespace characters allowed between two tokens of
    #: the JSON text. 0 (the default): compact JSON, one space after ':' and ',' and no other
    #: whitespace, so a weak model cannot spend its max_tokens on newlines between keys.
    json_whitespace: int = 0

    @property
    def grammar_key(self) -> tuple[GuidedKind, str, tuple[str, ...], int]:
        """What the compiled grammar depends on (not the per-request token count)."""
        return (self.kind, self.spec, self.choices, self.json_whitespace)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. Defaults are the OpenAI/vLLM defaults; see common.proto."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    #: None: no logprobs; k >= 0: sampled token's logprob plus k alternatives.
    top_logprobs: int | None = None
    #: None: none; k >= 0: the logprob of every prompt token after the first, plus k
    #: alternatives each (such a request bypasses the prefix cache: cached tokens have no logits).
    prompt_logprobs: int | None = None
    #: None: unconstrained; else the constraint the output must follow.
    guided: GuidedDecoding | None = None
    #: False: this request is never speculated (the engine decodes it one token per step even
    #: with a proposer configured). True: the engine may speculate for it.
    speculative: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    #: Speculative decoding: drafted tokens the target model accepted / rejected for this request
    #: (both 0 when it was not speculated).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of a paged KV cache; blocks move between workers only when layouts are equal."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    #: Ranks the KV heads are split over (each holds num_kv_heads of them).
    tensor_parallel_size: int = 1

    def mismatch(self, other: KvLayout) -> str | None:
        """A message naming every field that differs from `other`, or None when compatible."""
        diffs = [
            f"{name} {getattr(other, name)} != {getattr(self, name)}"
            for name in ("tensor_parallel_size", "dtype", "num_layers", "num_kv_heads",
                         "head_size", "block_size")
            if getattr(self, name) != getattr(other, name)
        ]
        if not diffs:
            return None
        hint = (" (both sides need the same --tensor-parallel-size)"
                if self.tensor_parallel_size != other.tensor_parallel_size else "")
        return "KV layout mismatch (handle vs worker): " + ", ".join(diffs) + hint

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V over every layer."""
        element = _ELEMENT_BYTES.get(self.dtype, 2)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element


_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True, slots=True)
class MemoryDescriptor:
    address: int
    length: int
    device_id: int = 0


@dataclass(frozen=True, slots=True)
class TrtllmParams:
    """TensorRT-LLM DisaggregatedParams of a context-only request (see TrtllmDisaggParams)."""

    opaque_state: bytes = b""
    first_gen_tokens: tuple[int, ...] = ()
    ctx_request_id: int | None = None
    draft_tokens: tuple[int, ...] = ()
    disagg_request_id: int | None = None


@dataclass(frozen=True, slots=True)
class RankSource:
    """One tensor-parallel rank's shard of a prefilled prompt's KV (KvRankSource)."""

    nixl_agent_name: str
    nixl_agent_metadata: bytes
    descriptors: tuple[MemoryDescriptor, ...]


@dataclass(frozen=True, slots=True)
class KvHandle:
    """Where a prefilled prompt's KV lives (see KvHandle in common.proto)."""

    worker_id: str
    worker_address: str
    request_id: str
    backend: str  # "nixl" | "trtllm" | "mock"
    layout: KvLayout
    num_tokens: int
    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()
    nixl_agent_name: str = ""
    nixl_agent_metadata: bytes = b""
    descriptors: tuple[MemoryDescriptor, ...] = ()
    nixl_memory_type: str = ""
    lease_expiry_unix_ms: int = 0
    #: Present when backend == "trtllm".
    trtllm_params: TrtllmParams | None = None
    #: A tensor-parallel prefill worker's ranks past the first (the fields above: rank 0's).
    ranks: tuple[RankSource, ...] = ()


@dataclass(frozen=True, slots=True)
class NixlTensorRef:
    agent_name: str
    agent_metadata: bytes
    descriptor: MemoryDescriptor
    memory_type: str


@dataclass(frozen=True, slots=True)
class Embedding:
    """One multimodal item of a prompt, placed at its placeholder tokens, in one of two forms:

    - encoded: `dtype` is an element type ("float32", "bfloat16", "float16"), `shape` is
      (num_tokens, hidden_size) and `data` the row-major tensor bytes or a NIXL reference;
    - not yet encoded (no encode worker ran; the aggregated fallback): `dtype` is the image's
      MIME type ("image/png", "image/jpeg", "image/webp"), `shape` is (num_tokens,) and `data`
      the image file's bytes. The engine that computes the placeholder tokens runs its own vision
      encoder over it.

    `content_hash` is the hex SHA-256 of the image file (tandem.multimodal.image.content_hash)
    in both forms, so both give the same KV block hashes.
    """

    content_hash: str
    shape: tuple[int, ...]
    dtype: str
    data: bytes | NixlTensorRef
    placeholder_offset: int = 0

    @property
    def is_image(self) -> bool:
        """True for an image not yet encoded (`dtype` is a MIME type)."""
        return self.dtype.startswith("image/")

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens the item covers (one for a shapeless item)."""
        if self.is_image:
            return self.shape[0] if self.shape else 1
        return self.shape[-2] if len(self.shape) >= 2 else 1


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    #: Present: resume from KV a prefill worker computed (disaggregated decode).
    kv_handle: KvHandle | None = None
    #: With kv_handle: the first token the prefill worker sampled; emitted first.
    first_token: TokenLogprob | None = None
    embeddings: tuple[Embedding, ...] = ()


@dataclass(slots=True)
class TokenChunk:
    """Tokens produced since the consumer last asked. finish_reason/usage only on the last."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    #: Prompt tokens served from the prefix cache; on the first chunk after the engine knows it.
    cached_tokens: int | None = None
    #: With SamplingParams.prompt_logprobs: one entry per prompt token after the first, on the
    #: first chunk.
    prompt_logprobs: list[TokenLogprob] | None = None
    #: time.time_ns() when the frontend read this chunk from the decode worker, on one chunk of
    #: each batch it reads (0 on the others): where the last hop's latency (to the client's
    #: socket) is measured from.
    received_ns: int = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: TokenLogprob
    kv_handle: KvHandle | None
    cached_tokens: int
    #: Set when the request finished on its first token; then kv_handle is None.
    finish_reason: FinishReason | None = None


# KV events, the same vocabulary as KvEvents in kv_events.proto and Dynamo's KV events.


class KvTier(enum.Enum):
    """Where a cached KV block lives (KvTier in kv_events.proto): the engine's device pool, or
    the host-memory tier behind it (--kv-host-cache-bytes), from which a prefix hit is copied
    back instead of recomputed."""

    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    mm_hashes: tuple[str, ...] = ()
    #: The tier the blocks are now stored in (a block may be in both tiers at once).
    tier: KvTier = KvTier.DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    #: The tier the blocks left (they may still be stored in the other one).
    tier: KvTier = KvTier.DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    pending_prefill_tokens: int
    active_decode_blocks: int
    prefix_cache_hit_rate: float
    #: Disaggregation: prefill leases held, requests whose KV is being read, and counters.
    kv_leases: int = 0
    num_loading: int = 0
    kv_lease_expiries: int = 0
    kv_bytes_received: int = 0
    kv_transfers_ok: int = 0
    kv_transfers_failed: int = 0
    #: Engines with a vision encoder: images encoded, those answered from the encoder cache
    #: (by content hash), and images in that cache now.
    num_encoded_images: int = 0
    encode_cache_hits: int = 0
    encode_cache_size: int = 0
    #: Host KV tier (--kv-host-cache-bytes; all 0 without one): blocks it holds and can hold,
    #: blocks and bytes copied device -> host (offload) and host -> device (onboard), seconds
    #: those copies took, and the share of looked-up prompt tokens served from it (0..1).
    kv_host_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    kv_offload_blocks: int = 0
    kv_offload_bytes: int = 0
    kv_offload_seconds: float = 0.0
    kv_onboard_blocks: int = 0
    kv_onboard_bytes: int = 0
    kv_onboard_seconds: float = 0.0
    kv_host_hit_rate: float = 0.0
    #: KV transfer buffer (tandem.kv.transfer_buffer; 0 without one, or before the worker's
    #: first transfer): blocks its slots hold now and can hold, and reads that went through it
    #: against those that went region by region (a prompt that did not fit a buffer).
    kv_transfer_buffer_blocks_used: int = 0
    kv_transfer_buffer_blocks_total: int = 0
    kv_reads_buffered: int = 0
    kv_reads_by_region: int = 0
    #: Speculative decoding (tandem.engines.speculative.speculation.SpecCounters): verify
    #: passes of one request with proposals, tokens proposed and accepted, and how often the
    #: proposal at each position (1 first) was accepted.
    spec_verify_passes: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One KV read by a decode worker, as its engine reports it when the read ends."""

    request_id: str
    #: The prefill worker the KV came from.
    source_worker_id: str
    #: Bytes read (0 when the read failed).
    num_bytes: int
    #: Wall-clock start, ns since the epoch; and how long the read took, seconds.
    start_unix_ns: int
    duration_s: float
    #: Why the read failed (lease expired, transfer error); None: it completed.
    error: str | None = None
