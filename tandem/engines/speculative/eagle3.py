"""The EAGLE-3 proposer: a one-layer head over the target's hidden states guesses k tokens.

The head (eagle3_head) keeps its own paged KV, addressed through the target's block tables as a
draft model's is (draft_kv). Its input at position p is the embedding of token p + 1 and the
target's hidden states at p (three layers' residual streams, aux_states, through `fc`); its
output at p guesses token p + 2. So the target's states of every position it computes are kept
per request (`observe`, after each step) until a proposal consumes them. A proposal:

1. catch-up: one head forward over the positions whose target states it has not consumed
   (the prompt the first time, then those the last verify pass accepted: their KV is then
   computed from the target's states, as the head was trained), whose last row (position
   n - 1, n = the target's computed tokens) guesses token n + 1 (guess 1);
2. k - 1 steps, each at the next position over the previous guess and the head's own output
   hidden state (before its final norm), as EAGLE-3 feeds itself.

Guesses are the head's greedy argmax over its draft vocabulary, mapped to target ids by `d2t`:
deterministic, so the engine's draw-and-compare verification stays exact whatever they are.

Positions whose target states this engine never saw get no head KV of their own: a prefix-cache
hit's (the head reads what the request that computed those blocks left there), a decode
worker's prompt in disaggregated serving (prefilled elsewhere: the head starts from the
positions the decode worker computes), and the positions of steps that did not speculate
(batch-size policy: only each request's last state is kept then, so that large batches hold
no states). The head then attends over whatever its cache holds at those positions; the output
is the same either way, only fewer proposals are accepted. Table changes (preemption) reset
what it computed.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.engines.batching.request import BatchRequest
from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.spec import ModelSpec
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.draft_kv import DraftKv, PagedDraftProposer, Span, draft_batch
from tandem.engines.speculative.eagle3_head import Eagle3Head, load_eagle3_head
from tandem.engines.speculative.proposer import StepSpan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Eagle3State(DraftKv):
    """One request's head KV (`computed`: the positions whose KV the head computed from the
    target's states) and the target states it has not consumed yet."""

    #: Target states of consecutive positions from `first`: [positions, n * hidden] pieces.
    first: int = 0
    pieces: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        """One past the last position whose target state is kept."""
        return self.first + sum(p.shape[0] for p in self.pieces)

    def add(self, start: int, states: torch.Tensor) -> None:
        """Keeps the target's states of positions [start, start + len(states)), replacing any
        kept for those positions or after (a recompute, or a verify pass's rejected rows)."""
        if not self.pieces or not self.first <= start <= self.end:
            self.first, self.pieces = start, [states]
            return
        kept, position = [], self.first
        for piece in self.pieces:
            if position >= start:
                break
            kept.append(piece[:start - position])
            position += piece.shape[0]
        self.pieces = [*kept, states]

    def take(self, start: int, stop: int) -> torch.Tensor:
        """The states of positions [start, stop) (kept), forgetting all of them."""
        states = torch.cat(self.pieces) if len(self.pieces) > 1 else self.pieces[0]
        out = states[start - self.first:stop - self.first]
        self.pieces = []
        return out


class Eagle3Proposer(PagedDraftProposer):
    """Greedy chains from an EAGLE-3 head."""

    def __init__(self, config: SpeculativeConfig, head: Eagle3Head, kv_cache: torch.Tensor,
                 device: torch.device, block_size: int) -> None:
        super().__init__(config, kv_cache, device, block_size)
        self.head = head
        self.aux_layers = head.spec.aux_layers

    @classmethod
    def load(cls, config: SpeculativeConfig, target: ModelSpec, embedding: torch.Tensor,
             num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
             load_format: str = "auto", seed: int = 0) -> Eagle3Proposer:
        """Loads the head named by the config for `target` (whose embedding weight it shares
        when it has none) and a one-layer KV cache of `num_blocks` blocks.

        Raises:
            InvalidRequest (param "speculative_config"): as eagle3_head.load_eagle3_head.
        """
        assert config.model is not None
        head = load_eagle3_head(config.model, target, embedding, dtype, device, load_format,
                                seed)
        layer = head.spec.layer
        kv_cache = allocate_kv_cache(1, num_blocks, block_size, layer.num_kv_heads,
                                     layer.head_size, dtype, device)
        log.info("EAGLE-3 head loaded", extra={
            "draft_model": config.model, "aux_layers": list(head.spec.aux_layers),
            "draft_vocab_size": head.spec.draft_vocab_size,
            "draft_kv_bytes": kv_cache.numel() * kv_cache.element_size()})
        return cls(config, head, kv_cache, device, block_size)

    def observe(self, spans: Sequence[StepSpan], states: torch.Tensor, keep_all: bool) -> None:
        for req, row, start, count in spans:
            if req.is_finished or not req.sampling.speculative or req.lease_ms is not None:
                continue
            state = req.draft_state
            if not isinstance(state, Eagle3State):
                state = req.draft_state = Eagle3State()
            if keep_all:
                state.add(start, states[row:row + count])
            else:  # only the last position's (a proposal can start from it), in a copy
                state.first = start + count - 1
                state.pieces = [states[row + count - 1:row + count].clone()]

    @torch.inference_mode()
    def propose(self, reqs: Sequence[BatchRequest], ks: Sequence[int],
                blocks: Sequence[list[int]] | None = None) -> list[list[int]]:
        """Runs in a worker thread; reads each request's tokens and kept states (stable until
        the step after it is scheduled) and writes through `blocks`."""
        assert blocks is not None
        out: list[list[int]] = [[] for _ in reqs]
        chosen: list[int] = []  # indices of the requests with the states to propose from
        spans: list[Span] = []
        states: list[torch.Tensor] = []
        for j, (req, table) in enumerate(zip(reqs, blocks, strict=True)):
            state = req.draft_state
            if not isinstance(state, Eagle3State):
                continue
            state.check_blocks(table, self.block_size)
            n = req.num_computed  # Speculation.budget: every token but the last computed
            if not state.pieces or state.first > n - 1 or state.end < n:
                continue  # no target state of position n - 1 (not computed here)
            start = min(max(state.computed, state.first), n - 1)
            spans.append((req.token_ids[start + 1:n + 1], start))
            states.append(state.take(start, n))
            state.computed, state.blocks = n, table
            chosen.append(j)
        if not chosen:
            return out
        tables = [blocks[j] for j in chosen]
        guesses, hidden = self._step(spans, tables, self.head.combine(torch.cat(states)))
        for j, g in zip(chosen, guesses, strict=True):
            out[j].append(g)
        for i in range(1, max(ks[j] for j in chosen)):
            rows = [r for r, j in enumerate(chosen) if ks[j] > i]
            steps = [([out[chosen[r]][-1]], reqs[chosen[r]].num_computed + i - 1) for r in rows]
            index = torch.tensor(rows, device=hidden.device)
            guessed, hidden_rows = self._step(steps, [tables[r] for r in rows],
                                              hidden.index_select(0, index))
            hidden = hidden.index_copy(0, index, hidden_rows)
            for r, g in zip(rows, guessed, strict=True):
                out[chosen[r]].append(g)
        return out

    def _step(self, spans: Sequence[Span], tables: Sequence[Sequence[int]],
              hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """One head forward over each (tokens, first position) span with input hidden states
        `hidden` (a row per token); the greedy token after each span's last row, and that
        row's output hidden state [S, hidden]."""
        batch = draft_batch(spans, tables, self.block_size, self.device)
        out = self.head(batch.input_ids, batch.positions, hidden, batch.meta, self.kv_cache)
        last = out.index_select(0, batch.last_rows)
        return [int(t) for t in self.head.next_tokens(last).tolist()], last
