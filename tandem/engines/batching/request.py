"""Per-request state of a continuous-batching engine (mock and reference)."""
from __future__ import annotations

import contextvars
import enum

from tandem.engines.guided.matcher import Guide
from tandem.engines.stream import RequestStream
from tandem.engines.types import EngineRequest, SamplingParams, TokenLogprob
from tandem.kv.block_pool import BlockTable
from tandem.kv.hashing import hash_block
from tandem.multimodal.placeholders import mm_hashes_per_block


class RequestStatus(enum.Enum):
    """A request's phase, for its whole life. The scheduler admits (WAITING -> RUNNING), the
    KV reads of disaggregation load (RUNNING -> LOADING -> RUNNING), and one engine method
    ends it (BatchingEngine._end: -> FINISHED), whichever way it ends (finished, aborted,
    failed, or leased by a prefill worker)."""

    #: Not admitted yet: no blocks, nothing computed.
    WAITING = "waiting"
    #: Admitted: scheduled, or preempted back to the waiting queue (its cached-token count
    #: stays the one of its first admission).
    RUNNING = "running"
    #: Admitted, and its prompt's KV is being read into its blocks: they must not be freed
    #: until the read ends (tandem.engines.batching.transfers).
    LOADING = "loading"
    #: Ended: never scheduled again; its blocks are released or handed to a lease.
    FINISHED = "finished"


class BatchRequest:
    """One request's tokens, progress and KV blocks.

    `token_ids` is the prompt followed by every output token; `num_computed` counts the leading
    tokens whose KV is (or is being) computed. A step computes tokens [num_computed, len) in
    chunks; when it reaches the end the request samples its next token. Preemption only resets
    `num_computed` and the block table, so recomputation reproduces the same state.
    """

    __slots__ = ("request_id", "sampling", "stream", "token_ids", "num_prompt", "num_output",
                 "num_computed", "num_cached", "table", "hashes", "mm_per_block", "key",
                 "first_token", "status", "stop_ids", "min_tokens", "prompt_logprobs",
                 "kv_handle", "lease_ms", "context", "embeddings", "guide", "num_pending",
                 "num_draft", "draft_state", "draft_masks", "num_proposed", "num_accepted")

    def __init__(self, request: EngineRequest, stream: RequestStream, key: int,
                 eos_ids: frozenset[int], block_size: int, lease_ms: int | None = None,
                 guide: Guide | None = None) -> None:
        self.request_id = request.request_id
        self.sampling: SamplingParams = request.sampling
        self.stream = stream
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt = len(self.token_ids)
        self.num_output = 0
        self.num_computed = 0
        #: Prompt tokens served from the prefix cache at first admission (reported in Usage).
        self.num_cached = 0
        self.table = BlockTable()
        #: Chained hashes of the full blocks of token_ids, extended lazily.
        self.hashes: list[int] = []
        self.mm_per_block = _mm_hashes_per_block(request, block_size)
        #: Multimodal items placed at their placeholder tokens when those are computed.
        self.embeddings = request.embeddings
        self.key = key
        #: Set for a disaggregated request until its first token is emitted.
        self.first_token: TokenLogprob | None = (
            request.first_token if request.kv_handle is not None else None)
        #: Where the prompt's KV is read from (disaggregated decode); None once loaded, or when
        #: the engine falls back to computing the prompt itself.
        self.kv_handle = request.kv_handle
        #: The admitting call's context (its request id, its trace span), for the KV read
        #: that runs later in a task of its own.
        self.context = contextvars.copy_context() if request.kv_handle is not None else None
        #: Set for a prefill-only request: after its first token the blocks are leased this
        #: long instead of freed.
        self.lease_ms = lease_ms
        self.status = RequestStatus.WAITING
        # EOS stops a request unless ignore_eos (as in vLLM). The mock never draws EOS itself,
        # but a prefill worker's first token may be one.
        stop = set(request.sampling.stop_token_ids)
        if request.sampling.ignore_eos:
            stop -= eos_ids
        else:
            stop |= eos_ids
        self.stop_ids = frozenset(stop)
        self.min_tokens = request.sampling.min_tokens
        #: Prompt logprobs computed so far, by position - 1 (engines that compute them).
        self.prompt_logprobs: list[TokenLogprob] = []
        #: With SamplingParams.guided: where the output stands in its grammar. Moved only by
        #: emitted tokens (see tandem.engines.guided.matcher).
        self.guide = guide
        #: 1 while token_ids ends with a token still on the device (a PLACEHOLDER: see
        #: tandem.engines.batching.ahead), else 0.
        self.num_pending = 0
        #: Proposed tokens at the end of token_ids, not verified yet (speculative decoding:
        #: set before a step schedules them, cleared when its samples are applied).
        self.num_draft = 0
        #: The proposer's own per-request state (an n-gram index, a draft model's progress).
        self.draft_state: object = None
        #: A guided request's grammar masks of the verify pass's rows (Guide.masks_along; a
        #: torch.Tensor [num_draft + 1 or more, words]), None without proposals.
        self.draft_masks: object = None
        #: Tokens proposed for this request, and those its verify passes accepted (Usage).
        self.num_proposed = 0
        self.num_accepted = 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def was_admitted(self) -> bool:
        return self.status is not RequestStatus.WAITING

    @property
    def is_loading(self) -> bool:
        """Whether a transfer writes its blocks now (they must not be freed)."""
        return self.status is RequestStatus.LOADING

    @property
    def is_prefilling(self) -> bool:
        """Whether its next computed tokens are prompt (or recomputed) tokens, not a decode."""
        return (self.num_output == 0
                or self.num_computed < len(self.token_ids) - 1 - self.num_draft)

    @property
    def num_final(self) -> int:
        """Tokens known for good: token_ids without a placeholder or proposed tokens."""
        return len(self.token_ids) - self.num_pending - self.num_draft

    def add_drafts(self, token_ids: list[int]) -> None:
        """Appends proposed tokens, to be computed and verified by the next step."""
        self.token_ids.extend(token_ids)
        self.num_draft = len(token_ids)
        self.num_proposed += len(token_ids)

    def drop_drafts(self, count: int | None = None) -> list[int]:
        """Takes the last `count` (default: all) proposed tokens back out of token_ids and
        returns them."""
        count = self.num_draft if count is None else min(count, self.num_draft)
        if count == self.num_draft:
            self.draft_masks = None
        if not count:
            return []
        dropped = self.token_ids[-count:]
        del self.token_ids[-count:]
        self.num_draft -= count
        return dropped

    def block_hashes(self, num_blocks: int, block_size: int) -> list[int]:
        """The chained hashes of the first `num_blocks` full blocks (computed once, cached)."""
        hashes = self.hashes
        tokens = self.token_ids
        mm = self.mm_per_block
        while len(hashes) < num_blocks:
            i = len(hashes)
            extra = mm[i] if mm is not None and i < len(mm) else ()
            hashes.append(hash_block(hashes[-1] if i else None,
                                     tokens[i * block_size:(i + 1) * block_size], extra))
        return hashes


def _mm_hashes_per_block(request: EngineRequest, block_size: int) -> list[tuple[str, ...]] | None:
    """Content hashes of the multimodal items touching each block, None without items."""
    return mm_hashes_per_block(request.embeddings, len(request.prompt_token_ids), block_size)
