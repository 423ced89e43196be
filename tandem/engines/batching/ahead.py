"""Overlap scheduling: the next decode step is scheduled and launched while the device still
computes the current one, so that the host's work between steps (applying and streaming the
tokens, scheduling, building the inputs) hides behind the device's instead of adding to it (as
TensorRT-LLM's overlap scheduler and vLLM's async scheduling do).

A step launched ahead (`StepAhead`) takes its input tokens from the previous step's sampled
tokens on the device. Until those reach the host, each of its requests carries a PLACEHOLDER
as its last token: the scheduler sees one token to compute, as usual, and never hashes a block
holding a placeholder. The engine runs ahead only where nothing needs the host's view of the
tokens first:

- every scheduled request decodes one token and samples, and none is penalized (the penalties
  read the token history) or a prefill worker's (its blocks are leased once its first token is
  known);
- nothing waits or is loaded (admitting needs the tokens' blocks settled), no request must be
  preempted for its next block, and no copy to or from the host tier is queued;
- no debug hook is armed to pause the loop.

A guided request's grammar mask needs its previous token on the host: the step ahead computes
its logits, then waits for the previous step's tokens, takes them into the grammars (`taken`)
and fills the mask while the device computes, then samples.

A request that the settled step finishes has one more row computed in the step ahead; its
result is dropped. That row writes the KV of a position nobody will read, in a block freed
meanwhile: a schedule that runs ahead only appends blocks to running requests, whose writes the
device orders after it, and every other schedule settles the step first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tandem.engines.batching.request import BatchRequest
from tandem.engines.batching.scheduler import Scheduler, StepPlan
from tandem.engines.types import TokenLogprob

#: The token a ready request samples this step, with its logprobs when asked for.
Sampled = tuple[int, TokenLogprob | None]

#: Stands in a request's token_ids for a token sampled on the device but not yet read back.
PLACEHOLDER = -1


class StepAhead(ABC):
    """A step launched without waiting for its tokens (BatchingEngine._launch)."""

    def __init__(self, reqs: list[BatchRequest]) -> None:
        #: The requests that sample in it, in row order.
        self.reqs = reqs
        #: Whether the step launched after it took its tokens into their requests' grammars
        #: (then settling it must not take them again).
        self.taken = False

    @abstractmethod
    async def sampled(self) -> list[Sampled]:
        """Its tokens, one per request in `reqs`, once the device has them. Raises what the
        step raised."""

    async def host_done(self) -> None:
        """Returns once the launch no longer needs the host. A guided step's launch takes the
        previous step's tokens into the grammars and fills its mask while the device computes
        the step; the loop waits for that before it schedules and builds the next step,
        whose Python would otherwise compete with the grammars' for the interpreter while the
        device waits for the mask."""
        return None

    def alive_rows(self) -> list[int] | None:
        """Rows of `reqs` still running (not finished or aborted since the launch); None when
        all of them are."""
        rows = [i for i, r in enumerate(self.reqs) if not r.is_finished]
        return None if len(rows) == len(self.reqs) else rows


def runs_ahead(req: BatchRequest) -> bool:
    """Whether a request's steps may launch before its previous token reaches the host."""
    p = req.sampling
    return (req.lease_ms is None and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)


def is_plain_decode(plan: StepPlan) -> bool:
    """Whether every request of `plan` computes one token and samples, and nothing else
    happens in it (no first tokens of transfers, no reads, no preemption)."""
    return (bool(plan.scheduled) and not plan.first_tokens and not plan.loads
            and not plan.num_preempted and len(plan.ready) == len(plan.scheduled)
            and all(n == 1 and runs_ahead(r) for r, n in plan.scheduled))


def may_schedule_ahead(scheduler: Scheduler, ahead: StepAhead) -> bool:
    """Whether the next step can be scheduled before `ahead`'s tokens are known: the requests
    running are exactly those of `ahead` still alive, nothing else waits, and each can take
    its next token's block without a preemption."""
    if scheduler.waiting or scheduler.loaded:
        return False
    alive = [r for r in ahead.reqs if not r.is_finished]
    if scheduler.running != alive:
        return False
    bs = scheduler.block_size
    needed = sum(1 for r in alive if len(r.token_ids) > len(r.table.block_ids) * bs)
    return needed <= scheduler.pool.num_free


def same_requests(plan: StepPlan, reqs: Sequence[BatchRequest]) -> bool:
    """Whether `plan` samples exactly `reqs`, in that order."""
    return len(plan.ready) == len(reqs) and all(a is b for a, b in zip(plan.ready, reqs))
