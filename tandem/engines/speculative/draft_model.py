"""The draft-model proposer: a small model of the target's tokenizer guesses k tokens greedily.

The draft keeps its own KV cache, paged like the target's and addressed through the SAME block
tables (tandem.engines.speculative.draft_kv).

Per request the draft knows how far its own KV is valid (`DraftState.computed`). A proposal:

1. catch-up: one forward over the tokens it has not computed yet (the whole prompt the first
   time, then the tokens the last verify pass emitted), whose last row gives guess 1;
2. k - 1 decode steps, each feeding the previous guess.

What verification accepted is read back from the request's tokens at the next proposal: the
draft's KV of guesses 1..k-1 is valid as far as they match what was emitted. Table changes
(preemption frees and replaces the blocks) reset it to nothing. Greedy guesses make the
proposal deterministic, so the engine's draw-and-compare verification stays exact.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.engines.batching.request import BatchRequest
from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.parallel.group import TensorGroup
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.draft_kv import DraftKv, PagedDraftProposer, Span, draft_batch
from tandem.errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftState(DraftKv):
    """Where the draft's KV of one request stands."""

    #: The last proposal and the position its first guess was for.
    base: int = 0
    guesses: list[int] = field(default_factory=list)

    def settle(self, tokens: Sequence[int], blocks: Sequence[int], block_size: int) -> None:
        """Takes in what the last verify pass emitted and whether the blocks survived."""
        if self.guesses:
            # Guesses 1..k-1 were fed back: their KV is valid while they match the tokens.
            fed = self.guesses[:-1]
            matched = 0
            while (matched < len(fed) and self.base + matched < len(tokens)
                   and tokens[self.base + matched] == fed[matched]):
                matched += 1
            self.computed = min(self.base + matched, len(tokens) - 1)
            self.guesses = []
        self.check_blocks(blocks, block_size)


class DraftModelProposer(PagedDraftProposer):
    """Greedy proposals from a draft model over its own paged KV cache."""

    def __init__(self, config: SpeculativeConfig, model: DecoderModel, kv_cache: torch.Tensor,
                 device: torch.device, block_size: int) -> None:
        super().__init__(config, kv_cache, device, block_size)
        self.model = model

    @classmethod
    def load(cls, config: SpeculativeConfig, target_vocab: int, num_blocks: int,
             block_size: int, dtype: torch.dtype, device: torch.device,
             load_format: str = "auto", seed: int = 0) -> DraftModelProposer:
        """Loads the draft named by the config and a KV cache of `num_blocks` blocks (the
        target pool's count, scratch block included).

        Raises:
            InvalidRequest (param "speculative_config"): the draft cannot be loaded, or its
                vocabulary differs from the target's (its token ids would mean other tokens).
        """
        assert config.model is not None
        try:
            model, spec = load_model(config.model, dtype, device, load_format, seed,
                                     TensorGroup())
        except (InvalidRequest, OSError, ValueError) as exc:
            raise InvalidRequest(f"speculative config: the draft model {config.model!r} cannot "
                                 f"be loaded: {exc}", param="speculative_config") from exc
        if spec.vocab_size != target_vocab:
            raise InvalidRequest(f"speculative config: the draft model's vocabulary has "
                                 f"{spec.vocab_size} tokens, the target's {target_vocab}: they "
                                 "must share one tokenizer", param="speculative_config")
        kv_cache = allocate_kv_cache(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                                     spec.head_size, dtype, device)
        log.info("draft model loaded", extra={"draft_model": config.model,
                                               "draft_layers": spec.num_layers,
                                               "draft_kv_bytes": kv_cache.numel()
                                               * kv_cache.element_size()})
        return cls(config, model, kv_cache, device, block_size)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[BatchRequest], ks: Sequence[int],
                blocks: Sequence[list[int]] | None = None) -> list[list[int]]:
        """Runs in a worker thread; reads each request's tokens (stable until the step after
        it is scheduled) and writes through `blocks` (an abort frees them, but nothing reuses
        them before that step)."""
        assert blocks is not None
        bs = self.block_size
        states, tokens, tables = [], [], list(blocks)
        for req, table in zip(reqs, tables, strict=True):
            state = req.draft_state
            if not isinstance(state, DraftState):
                state = req.draft_state = DraftState()
            # All known (Speculation.budget: nothing pending or proposed): no copy per step.
            final = req.token_ids
            state.settle(final, table, bs)
            states.append(state)
            tokens.append(final)
        # 1. Catch-up: every token the draft has not computed; the last row guesses first.
        spans = [(final[s.computed:], s.computed) for s, final in zip(states, tokens)]
        guesses = [[g] for g in self._step(spans, tables)]
        for state, final, table in zip(states, tokens, tables, strict=True):
            state.computed = len(final)
            state.blocks = table
            state.base = len(final)
        # 2. Decode steps: feed each guess while a request wants more.
        for i in range(1, max(ks)):
            rows = [j for j, k in enumerate(ks) if k > i]
            spans = [([guesses[j][-1]], len(tokens[j]) + i - 1) for j in rows]
            for j, g in zip(rows, self._step(spans, [tables[j] for j in rows]), strict=True):
                guesses[j].append(g)
        for state, guess in zip(states, guesses, strict=True):
            state.guesses = guess
        return guesses

    def _step(self, spans: Sequence[Span], tables: list[list[int]]) -> list[int]:
        """One draft forward over each (tokens, first position) span; the greedy token after
        each span's last row."""
        batch = draft_batch(spans, tables, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache)
        logits = self.model.compute_logits(hidden.index_select(0, batch.last_rows))
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
