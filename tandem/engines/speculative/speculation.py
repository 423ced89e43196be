"""The engine's side of speculative decoding: which requests a step speculates for, how many
tokens each may be proposed, and what verification accepted.

One step, for a request that speculates (chain verification, no tree):

1. before scheduling, the proposer appends up to k proposals d_1..d_k to its tokens
   (`BatchRequest.add_drafts`); the scheduler then computes them with the last real token, k + 1
   positions, and never hashes a block holding a proposal;
2. the sampler draws one token per position, row i as a plain step would draw the token after
   the request's output plus d_1..d_i (same penalties, same seeded noise: draws are a function
   of the output position, see tandem.engines.reference.sampler);
3. `accepted` counts the leading rows whose draw equals the proposal; the request emits those
   draws and the next one (the correction, or the bonus token when all k were accepted).

So the emitted tokens are exactly those plain decoding draws, greedy or sampled, seeded or not
in distribution: a draw that matches a deterministic proposal is what the target would have
drawn there, and the first mismatch is the target's own draw at that position (for a one-hot
proposal this is Leviathan et al.'s rejection sampling: accept with p(d), else draw from p with
d removed). The KV of rejected positions is rolled back by forgetting it: `num_computed` falls
back to the accepted tokens and the blocks taken only for rejected proposals are returned
(`BlockPool.truncate`).

Turned down twice over:

- by batch size: a step speculates only while at most `disable_by_batch_size` requests run,
  since a verify pass's extra positions cost little while a step is bound by reading the
  weights, and more than they save once the batch makes it compute-bound;
- by misses: a step that speculates cannot be launched ahead of the previous one's tokens
  (overlap scheduling: the proposer reads them), which costs a plain step its hidden host time
  (0.4 ms of a 4.6 ms step on the H200). So when a round finds nothing to propose for any
  request, the next rounds are skipped, 1, 2, 4 ... up to MAX_BACKOFF_STEPS steps, and overlap
  runs meanwhile; a round with a proposal resets it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.engines.batching.ahead import Sampled
from tandem.engines.batching.request import BatchRequest
from tandem.engines.guided.matcher import bitmask_words
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.proposer import Proposer
from tandem.engines.types import TokenLogprob
from tandem.kv.block_pool import BlockPool

#: Emits one token of a request (the engine's); True when it finished the request.
Emit = Callable[[BatchRequest, int, TokenLogprob | None], bool]

#: The most steps skipped after rounds that proposed nothing.
MAX_BACKOFF_STEPS = 16


@dataclass(slots=True)
class SpecCounters:
    """What speculation did on one engine, since it started (Prometheus counters)."""

    #: Verify passes of one request with at least one proposal.
    verify_passes: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    #: accepted_by_position[i]: verify passes whose proposal i + 1 was accepted.
    accepted_by_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.verify_passes += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        by_position = self.accepted_by_position
        if len(by_position) < proposed:
            by_position.extend([0] * (proposed - len(by_position)))
        for i in range(accepted):
            by_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify pass (accepted proposals + the target's own token)."""
        return 1 + self.accepted_tokens / self.verify_passes if self.verify_passes else 0.0


class Speculation:
    """One engine's speculative decoding: its settings, proposer and counters."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.counters = SpecCounters()
        #: Steps left to skip, and the length of the last skip (the backoff after misses).
        self._skip = 0
        self._backoff = 0

    def is_active(self, num_running: int) -> bool:
        """Whether this step, with `num_running` requests, speculates (the policies above).
        Called once per step."""
        limit = self.config.disable_by_batch_size
        if limit and num_running > limit:
            return False
        if self._skip:
            self._skip -= 1
            return False
        return True

    def proposed(self, any_tokens: bool) -> None:
        """Told after each round whether it proposed anything (the backoff after misses). A
        proposer that reads the target's hidden states never backs off: overlap scheduling,
        what skipped rounds buy, is off with it (tandem.engines.reference.engine), and a
        skipped round would drop the states it needs."""
        if any_tokens or self.proposer.aux_layers:
            self._backoff = 0
        else:
            self._backoff = min(max(1, 2 * self._backoff), MAX_BACKOFF_STEPS)
            self._skip = self._backoff

    def budget(self, req: BatchRequest) -> int:
        """How many tokens may be proposed for `req` now (0: none). Only a decoding request
        whose tokens are all known (none on the device, none proposed), whose grammar (if any)
        has not ended, and that is no prefill worker's; never more than its output has room
        for, so that no position past max_tokens is computed."""
        guide = req.guide
        if guide is not None and (guide.stopped or guide.rejected is not None):
            return 0
        if (not req.sampling.speculative or req.lease_ms is not None
                or req.is_finished or req.num_pending or req.num_draft or req.num_output == 0
                or req.num_computed != len(req.token_ids) - 1):
            return 0
        room = req.sampling.max_tokens - req.num_output - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    @staticmethod
    def accepted(drafts: Sequence[int], draws: Sequence[int]) -> int:
        """Leading proposals equal to the target's draws at their positions."""
        n = 0
        while n < len(drafts) and drafts[n] == draws[n]:
            n += 1
        return n

    async def propose(self, running: Sequence[BatchRequest], pool: BlockPool,
                      vocab_size: int) -> None:
        """Appends proposals to the running requests that may speculate, before the step is
        scheduled (which computes them with each request's last token); a guided request's
        grammar checks its proposals and masks each row of the verify pass."""
        proposer = self.proposer
        reqs, ks = [], []
        for req in running:
            k = self.budget(req)
            if k and proposer.writes_kv:
                # Its guesses 1..k-1 are fed back at the positions after the last token.
                needed = len(req.token_ids) + k - 1
                if not pool.can_append(req.table, needed):
                    continue  # the blocks are better left to the step itself
                pool.append(req.table, needed)
            if k:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            self.proposed(False)  # none may speculate: let overlap scheduling run meanwhile
            return
        blocks = [list(r.table.block_ids) for r in reqs] if proposer.writes_kv else None
        drafts = (await asyncio.to_thread(proposer.propose, reqs, ks, blocks)
                  if proposer.computes else proposer.propose(reqs, ks, blocks))
        self.proposed(any(drafts))
        for req, k, proposed in zip(reqs, ks, drafts, strict=True):
            if req.is_finished:  # an abort may have come meanwhile
                continue
            proposed = proposed[:k]
            if proposed and req.guide is not None:
                proposed, req.draft_masks = req.guide.masks_along(proposed,
                                                                  bitmask_words(vocab_size))
            if proposed:
                req.add_drafts(proposed)
            if proposer.writes_kv:  # the blocks taken for guesses not proposed go back
                pool.truncate(req.table, len(req.token_ids))

    def verify(self, req: BatchRequest, sampled: list[Sampled], emit: Emit,
               pool: BlockPool) -> bool:
        """Emits what one request's verify pass accepted (`sampled`: its 1 + num_draft rows):
        the draws that equal its proposals, then the next draw; rolls the rejected positions
        back. True when it finished."""
        drafts = req.drop_drafts()
        accepted = self.accepted(drafts, [token for token, _ in sampled])
        self.counters.record(len(drafts), accepted)
        req.num_accepted += accepted
        for token, logprob in sampled[:accepted + 1]:
            if emit(req, token, logprob):
                return True
        # The KV of the accepted tokens was computed from the right context; the rest is
        # dropped with the blocks taken for it.
        req.num_computed = len(req.token_ids) - 1
        pool.truncate(req.table, len(req.token_ids))
        return False
