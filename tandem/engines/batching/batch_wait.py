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
"""
from __future__ import annotations

import time

from tandem.engines.batching.scheduler import Scheduler


class BatchWait:
    """When the step loop may start a step that admits the waiting prompts."""

    def __init__(self, timeout_ms: float) -> None:
        self.timeout_s = max(timeout_ms, 0.0) / 1000
        #: When the current hold began (time.monotonic()); None: not holding.
        self._since: float | None = None

    def hold_s(self, scheduler: Scheduler) -> float:
        """Seconds to hold still before the next step (0: step now). Holds only while nothing
        runs and every waiting request is a prompt to compute that fits the batch and budget
        with the others."""
        if self.timeout_s <= 0 or not self._holds(scheduler):
            self._since = None
            return 0.0
        now = time.monotonic()
        if self._since is None:
            self._since = now
        left = self._since + self.timeout_s - now
        if left <= 0:
            self._since = None
            return 0.0
        return left

    @staticmethod
    def _holds(scheduler: Scheduler) -> bool:
        waiting = scheduler.waiting
        if scheduler.running or scheduler.loaded or not waiting:
            return False
        if len(waiting) >= scheduler.max_batch_size:
            return False
        tokens = 0
        for req in waiting:
            if req.kv_handle is not None:  # a disaggregated request: its KV is ready to read
                return False
            tokens += len(req.token_ids) - req.num_computed
        return tokens < scheduler.max_num_tokens
