"""Late binding of prompts to prefill workers (--prefill-queue-tokens).

Without it a disaggregated prompt goes to the router's prefill pick at once and waits in that
worker's queue, even when another worker frees first or a new one joins (the planner adding
workers under a burst of long prompts: the prompts already sent stay behind the one worker
that was serving). With it, this frontend sends each prefill worker at most `max_tokens`
prompt tokens not yet answered (a prompt always fits a worker that has none, however long);
a prompt that finds no worker with room waits here, first come first served. The head of the
line is routed again as it gets there (a worker it was given may have left), takes the first
of the router's ranked prefill workers with room whenever an answer frees some, and is routed
again every `recheck_s` while none does (so that workers that joined are seen). A re-routed
request's load is counted once by the router, its decisions once per routing; the router
charges it to its own first prefill pick, which may not be the one with room until the
workers' load reports say otherwise.

The bound is this frontend's own: with several frontend processes a worker may hold up to
their number times `max_tokens`.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable

from tandem.errors import DeadlineExceeded
from tandem.routing.workers import RouteDecision, WorkerRef

#: Seconds between the head of the line's routing attempts while no room frees (to see workers
#: that joined: a frontend's local router takes the router's list every 2 s). Each attempt is
#: one more routing decision in the router's counters.
RECHECK_S = 1.0


class PrefillGate:
    def __init__(self, max_tokens: int, recheck_s: float = RECHECK_S) -> None:
        if max_tokens <= 0:
            raise ValueError("the prefill queue bound must be > 0 tokens")
        self.max_tokens = max_tokens
        self.recheck_s = recheck_s
        #: Prompt tokens sent to each prefill worker (address) and not answered yet.
        self._outstanding: dict[str, int] = {}
        #: Prompts waiting for room, first come first served; the head's event is set.
        self._line: collections.deque[asyncio.Event] = collections.deque()
        self._freed = asyncio.Event()

    @property
    def num_waiting(self) -> int:
        return len(self._line)

    def outstanding(self, address: str) -> int:
        return self._outstanding.get(address, 0)

    async def admit(self, num_tokens: int, decision: RouteDecision,
                    reroute: Callable[[], Awaitable[RouteDecision]],
                    timeout_s: float | None) -> tuple[RouteDecision, WorkerRef | None]:
        """(the decision to serve the prompt by, the prefill worker whose room it took: first
        among the decision's prefill workers; None when the latest routing no longer
        disaggregates). Waits for room; DeadlineExceeded after `timeout_s`."""
        if not self._line:
            worker = self._with_room(decision, num_tokens)
            if worker is not None:
                return self._take(decision, worker, num_tokens)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        turn = asyncio.Event()
        self._line.append(turn)
        self._line[0].set()
        try:
            await self._until(turn, deadline, None)
            # At the head: routed again first (a worker it was given may have left).
            while True:
                decision = await reroute()
                if not decision.disaggregate:
                    return decision, None
                while True:  # room freed: the same decision's workers; none for a while: route
                    self._freed.clear()
                    worker = self._with_room(decision, num_tokens)
                    if worker is not None:
                        return self._take(decision, worker, num_tokens)
                    if not await self._until(self._freed, deadline, self.recheck_s):
                        break
        finally:
            self._line.remove(turn)
            if self._line:
                self._line[0].set()

    @staticmethod
    async def _until(event: asyncio.Event, deadline: float | None,
                     at_most_s: float | None) -> bool:
        """Whether `event` was set within `at_most_s` (None: however long); DeadlineExceeded
        once `deadline` (the loop's clock) passed first."""
        wait_s = at_most_s
        if deadline is not None:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise DeadlineExceeded("the request's deadline passed while its prompt waited "
                                       "for a prefill worker")
            wait_s = left if wait_s is None else min(wait_s, left)
        try:
            await asyncio.wait_for(event.wait(), wait_s)
            return True
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                raise DeadlineExceeded("the request's deadline passed while its prompt waited "
                                       "for a prefill worker") from None
            return False

    def release(self, worker: WorkerRef, num_tokens: int) -> None:
        """The prompt `admit` sent to `worker` was answered (or failed)."""
        left = self._outstanding.get(worker.address, 0) - num_tokens
        if left > 0:
            self._outstanding[worker.address] = left
        else:
            self._outstanding.pop(worker.address, None)
        self._freed.set()

    def _with_room(self, decision: RouteDecision, num_tokens: int) -> WorkerRef | None:
        for worker in decision.prefill_workers:
            held = self._outstanding.get(worker.address, 0)
            if not held or held + num_tokens <= self.max_tokens:
                return worker
        return None

    def _take(self, decision: RouteDecision, worker: WorkerRef,
              num_tokens: int) -> tuple[RouteDecision, WorkerRef]:
        self._outstanding[worker.address] = self._outstanding.get(worker.address, 0) + num_tokens
        others = tuple(w for w in decision.prefill_workers if w != worker)
        return dataclasses.replace(decision, prefill_workers=(worker, *others)), worker
