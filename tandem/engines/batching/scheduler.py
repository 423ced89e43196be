"""Continuous-batching scheduler shared by the engines (vLLM v1 / Dynamo mocker policy).

Each step: running requests first, in admission order, one decode token or one prefill chunk
each while the token budget lasts; a request that cannot get its blocks preempts the newest
running request (recompute: its blocks are freed and it goes back to the front of the waiting
queue). Then, if nothing was preempted, waiting requests are admitted FCFS while the batch size,
token budget and KV blocks allow; the first that does not fit stops admission.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.engines.batching.request import BatchRequest, RequestStatus
from tandem.kv.block_pool import BlockPool, PrefixMatch


@dataclass(slots=True)
class StepPlan:
    """What one step computes."""

    #: (request, tokens computed for it this step) in scheduling order.
    scheduled: list[tuple[BatchRequest, int]] = field(default_factory=list)
    #: Requests whose every token is computed at the end of the step: each samples one token.
    ready: list[BatchRequest] = field(default_factory=list)
    #: Disaggregated requests whose KV arrived: each emits its prefill worker's first token.
    first_tokens: list[BatchRequest] = field(default_factory=list)
    #: Disaggregated requests given blocks this step: the engine starts reading their KV.
    loads: list[BatchRequest] = field(default_factory=list)
    #: New (uncached) prompt or recomputed tokens in the step, the T of the timing model.
    prefill_tokens: int = 0
    num_preempted: int = 0
    num_admitted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def describe(self) -> str:
        """One line for logs: what the step holds."""
        return (f"{len(self.scheduled)} scheduled ({self.num_tokens} tokens, "
                f"{self.prefill_tokens} prefill), {len(self.ready)} sampling, "
                f"{len(self.first_tokens)} first tokens, {len(self.loads)} loads, "
                f"{self.num_admitted} admitted, {self.num_preempted} preempted")


class Scheduler:
    """Waiting and running queues over one BlockPool; `schedule` decides and allocates, the
    engine applies the outcome (tokens, finishes) and calls `drop` for requests that end."""

    def __init__(self, pool: BlockPool, max_batch_size: int, max_num_tokens: int) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []
        #: Transferred requests whose KV arrived; they join `running` at the next schedule.
        self.loaded: list[BatchRequest] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.loaded)

    def add(self, req: BatchRequest) -> None:
        self.waiting.append(req)

    def drop(self, req: BatchRequest) -> None:
        """Takes `req` out of its queue and frees its blocks (finish or abort)."""
        for queue in (self.running, self.waiting, self.loaded):
            try:
                queue.remove(req)
                break
            except ValueError:
                continue
        self.pool.free(req.table)

    def release(self, req: BatchRequest) -> None:
        """Frees a finished request's blocks; `compact` drops it from `running` later, so that a
        step finishing many requests does not pay a list removal for each."""
        self.pool.free(req.table)

    def compact(self) -> None:
        self.running = [r for r in self.running if not r.is_finished]

    def requeue(self, reqs: set[BatchRequest], plan: StepPlan) -> None:
        """Sends `reqs` (scheduled in `plan`, whose KV could not be copied back from the host
        tier) back to the front of the waiting queue to recompute, as a preemption would."""
        plan.scheduled = [(r, n) for r, n in plan.scheduled if r not in reqs]
        plan.ready = [r for r in plan.ready if r not in reqs]
        self.running = [r for r in self.running if r not in reqs]
        for req in reqs:
            self.pool.free(req.table)
            req.drop_drafts()
            req.num_computed = 0
            self.waiting.appendleft(req)
            self.num_preemptions += 1

    def _preempt_newest(self) -> BatchRequest:
        victim = self.running.pop()
        self.pool.free(victim.table)
        victim.drop_drafts()
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def _advance(self, req: BatchRequest, n: int, plan: StepPlan) -> None:
        if req.is_prefilling:
            plan.prefill_tokens += n
        req.num_computed += n
        plan.scheduled.append((req, n))
        # A block holding a token still on the device (a placeholder) is not hashed yet.
        # Nor one holding a proposed token: verification may reject it.
        full = min(req.num_computed, req.num_final) // self.block_size
        if full > req.table.num_committed and self.pool.enable_prefix_caching:
            hashes = req.block_hashes(full, self.block_size)
            self.pool.commit(req.table, req.token_ids, hashes, full, req.mm_per_block)
        if req.num_computed == len(req.token_ids):
            plan.ready.append(req)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        pool = self.pool
        budget = self.max_num_tokens
        running = self.running
        block_capacity = self.block_size

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = len(req.token_ids) - req.num_computed
            if n > budget:
                req.drop_drafts(n - budget)  # proposals go before the token they follow
                n = min(len(req.token_ids) - req.num_computed, budget)
            target = req.num_computed + n
            # Fast path: the request's last block still has room.
            if target > len(req.table.block_ids) * block_capacity:
                preempted_self = False
                while not pool.can_append(req.table, target):
                    plan.num_preempted += 1
                    if self._preempt_newest() is req:
                        preempted_self = True
                        break
                if preempted_self:
                    break  # req was the newest running request: nothing runs after it
                pool.append(req.table, target)
            self._advance(req, n, plan)
            budget -= n
            i += 1

        # Requests whose KV arrived already hold their blocks: they join whatever happened.
        for req in self.loaded:
            running.append(req)
            plan.first_tokens.append(req)
        self.loaded.clear()
        if plan.num_preempted:
            return plan  # as vLLM: no admissions in a step that had to preempt
        waiting = self.waiting
        while waiting and len(running) < self.max_batch_size:
            req = waiting[0]
            if req.is_finished:  # preempted ahead of its last token (see batching.ahead)
                waiting.popleft()
                continue
            if req.kv_handle is not None:
                # Blocks now, compute never: the engine reads the KV, then `loaded` resumes it.
                if not self.pool.can_allocate(req.num_prompt):
                    break
                self.pool.allocate(req.table, req.num_prompt)
                waiting.popleft()
                plan.loads.append(req)
                continue
            if budget <= 0 or not self._admit_local(req, budget, plan):
                break
            budget -= plan.scheduled[-1][1]
            waiting.popleft()
            running.append(req)
            plan.num_admitted += 1
        return plan

    def resume_loaded(self, req: BatchRequest) -> None:
        """A transferred request's KV has arrived: its prompt counts as computed (and cached)
        and it runs from the next step."""
        req.num_computed = req.num_prompt
        full = req.num_prompt // self.block_size
        if self.pool.enable_prefix_caching and full:
            hashes = req.block_hashes(full, self.block_size)
            self.pool.commit(req.table, req.token_ids, hashes, full, req.mm_per_block)
        self.loaded.append(req)

    def _admit_local(self, req: BatchRequest, budget: int, plan: StepPlan) -> bool:
        pool, bs = self.pool, self.block_size
        total = len(req.token_ids)
        match = PrefixMatch((), total)
        # Prompt logprobs need every prompt position's logits: no prefix hits for such requests.
        if pool.enable_prefix_caching and req.sampling.prompt_logprobs is None:
            # At least one token must be computed to produce logits, so never match it all.
            max_blocks = (total - 1) // bs
            match = pool.match_prefix(req.block_hashes(max_blocks, bs), total, max_blocks)
        # Host-tier hits count as cached: their KV is copied back before this step computes.
        cached = match.num_blocks * bs
        n = min(total - cached, budget)
        if not pool.can_allocate(cached + n, match):
            return False
        pool.allocate(req.table, cached + n, match)
        if req.status is RequestStatus.WAITING:
            req.num_cached = cached
            req.status = RequestStatus.RUNNING
            req.stream.set_cached_tokens(cached)
        req.num_computed = cached
        self._advance(req, n, plan)
        return True
