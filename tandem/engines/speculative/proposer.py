"""Proposers: what guesses a request's next tokens for the target to verify.

A proposer sees only tokens known for good (`BatchRequest.num_final`: no placeholder, no
earlier proposals) and keeps what it needs per request in `BatchRequest.draft_state`. Its
proposals are hints: the target's verify pass decides what is emitted, so a proposer can never
change the output, only how many steps it takes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.engines.batching.request import BatchRequest
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.ngram import NgramParams, NgramState

if TYPE_CHECKING:
    import torch

#: One request's rows of a target step: (request, first row, first position, row count).
StepSpan = tuple[BatchRequest, int, int, int]


class Proposer(ABC):
    """Guesses up to k next tokens for each of a batch of requests."""

    #: Whether `propose` computes (a model): the engine then runs it off the event loop.
    computes = False
    #: Whether it writes KV of its own at the positions it proposes for: the engine then
    #: gives each request the blocks for those positions first.
    writes_kv = False
    #: The target layers whose hidden states it reads (EAGLE-3: aux_states' convention); the
    #: engine then captures them in every step and hands them to `observe`. Empty: none.
    aux_layers: tuple[int, ...] = ()

    def observe(self, spans: Sequence[StepSpan], states: torch.Tensor, keep_all: bool) -> None:
        """Told after a target step (on the event loop, before its tokens are applied) the
        hidden states of `aux_layers` it computed, [rows, n * hidden], and which rows are
        whose (`spans`); `keep_all` False: the step did not speculate, so keep only what a
        proposal cannot start without. A proposer without `aux_layers` is never told."""
        del spans, states, keep_all  # it reads no hidden states

    @abstractmethod
    def propose(self, reqs: Sequence[BatchRequest], ks: Sequence[int],
                blocks: Sequence[list[int]] | None = None) -> list[list[int]]:
        """Up to ks[i] tokens for reqs[i] (fewer, or none, where it has no good guess).
        `blocks`: for a proposer that `writes_kv`, each request's block ids, taken on the
        event loop (an abort while it computes empties the request's table)."""


class NgramProposer(Proposer):
    """Prompt lookup (tandem.engines.speculative.ngram): the tokens that followed the latest
    earlier occurrence of the context's suffix."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.params = NgramParams(config.prompt_lookup_min, config.prompt_lookup_max,
                                  config.num_speculative_tokens)

    def propose(self, reqs: Sequence[BatchRequest], ks: Sequence[int],
                blocks: Sequence[list[int]] | None = None) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, ks, strict=True):
            state = req.draft_state
            if not isinstance(state, NgramState):
                state = req.draft_state = NgramState(self.params)
            state.extend(req.token_ids[state.num_tokens:req.num_final])
            out.append(state.propose(k))
        return out
