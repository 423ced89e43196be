"""Holding new prompts at an idle engine until a burst of them has arrived (opt-in).

A burst of requests reaches an idle engine one by one: the frontends parse, tokenize and route
them in turn. Without a hold, the first step takes the one or two that arrived, and the rest
wait for that step to end. It costs as much time as a full one when prefill is launch-bound,
so the burst's time to first token grows by a whole step. With `--batch-wait-timeout-ms`, an
engine with nothing running holds the prompts that wait for up to that long. It starts at once
when they fill the batch (`max_batch_size`) or a step's token budget (`max_num_tokens`). This
is TensorRT-LLM's `batch_wait_timeout_ms` (default 0, off, as here). Tandem holds only while
nothing runs, so no running request's decode steps are delayed. A lone request then pays the
whole timeout, so it is for bursty loads.

`--batch-wait-burst-ms` holds only while a burst is still arriving: at least two prompts wait
and the last one arrived less than BURST_GAP_MS ago. A lone request is never held (c1 TTFT
unchanged); the first of a burst starts alone, as without a hold, and the step after it takes
the rest of the burst in one go instead of the few that arrived during the first step. It
holds even while requests run (their next token waits for at most the hold), for at most that
many milliseconds, and starts at once when the prompts fill the batch or the token budget.
"""
from __future__ import annotations

import time

from tandem.engines.batching.scheduler import Scheduler

#: A burst is still arriving while its last prompt came less than this long ago.
BURST_GAP_MS = 3.0


class BatchWait:
    """When the step loop may start a step that admits the waiting prompts."""

    def __init__(self, timeout_ms: float, burst_ms: float = 0.0) -> None:
        self.timeout_s = max(timeout_ms, 0.0) / 1000
        self.burst_s = max(burst_ms, 0.0) / 1000
        #: When the current hold began (time.monotonic()); None: not holding.
        self._since: float | None = None
        #: When the last request arrived (`arrived`).
        self._last_arrival = float("-inf")

    def arrived(self) -> None:
        """A request was admitted (the burst hold's clock)."""
        self._last_arrival = time.monotonic()

    def hold_s(self, scheduler: Scheduler) -> float:
        """Seconds to hold still before the next step (0: step now): with the timeout, while
        nothing runs; with the burst hold, while at least two prompts wait and the last came
        under BURST_GAP_MS ago. Either way only while every waiting request is a prompt to
        compute that fits the batch and budget with the others."""
        now = time.monotonic()
        left = 0.0
        if self.timeout_s > 0 and not scheduler.running and self._fits(scheduler):
            left = self._left(now, self.timeout_s)
        elif self.burst_s > 0 and len(scheduler.waiting) >= 2 and self._fits(scheduler):
            quiet = now - self._last_arrival
            if quiet < BURST_GAP_MS / 1000:
                left = min(BURST_GAP_MS / 1000 - quiet, self._left(now, self.burst_s))
        if left <= 0:
            self._since = None
            return 0.0
        return left

    def _left(self, now: float, limit_s: float) -> float:
        if self._since is None:
            self._since = now
        return self._since + limit_s - now

    @staticmethod
    def _fits(scheduler: Scheduler) -> bool:
        waiting = scheduler.waiting
        if scheduler.loaded or not waiting:
            return False
        if len(waiting) + len(scheduler.running) >= scheduler.max_batch_size:
            return False
        tokens = 0
        for req in waiting:
            if req.kv_handle is not None:  # a disaggregated request: its KV is ready to read
                return False
            if req.num_computed:  # preempted: back in the queue, not arriving
                return False
            tokens += len(req.token_ids)
        return tokens < scheduler.max_num_tokens
