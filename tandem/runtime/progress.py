"""Health that proves progress: a worker reports NOT_SERVING while its engine is stuck.

A process that answers health checks is not necessarily an engine that computes: a step loop
blocked on a hung kernel, a deadlock or a lost peer leaves the gRPC server answering SERVING
while every request waits forever. The watchdog looks at the engine's own progress instead:
when the engine has queued work but has started no step for `timeout_s`, or when a periodic
one-token canary request fails (backends that cannot report progress, such as TensorRT-LLM),
the worker's health turns NOT_SERVING, so the router stops choosing it; the first step (or
canary) that succeeds again turns it back to SERVING.

An idle engine owes no progress, so it never turns unhealthy by being idle.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from tandem.engines.base import Progress
from tandem.errors import TandemError, Unimplemented

log = logging.getLogger(__name__)

#: Reports the verdict to whoever publishes health (GrpcService.set_serving in a worker).
SetServing = Callable[[bool], Awaitable[None]]


class ProgressSource(Protocol):
    """What the watchdog samples: an LLM engine, or a video worker's job runner."""

    def progress(self) -> Progress | None: ...

    async def health_canary(self, timeout_s: float) -> None: ...


@dataclass(frozen=True)
class WatchdogConfig:
    #: Queued work but no step started for this long, seconds: unhealthy. 0: not checked.
    progress_timeout_s: float = 30.0
    #: Seconds between health canary requests; 0: none.
    canary_interval_s: float = 0.0
    #: Longest a canary may take, seconds.
    canary_timeout_s: float = 30.0

    @property
    def is_enabled(self) -> bool:
        return self.progress_timeout_s > 0 or self.canary_interval_s > 0

    @property
    def check_interval_s(self) -> float:
        """How often progress is sampled: a few times per timeout, so that a stall is seen
        within ~1.25 timeouts."""
        intervals = [t / 4 for t in (self.progress_timeout_s,) if t > 0]
        intervals += [self.canary_interval_s] if self.canary_interval_s > 0 else []
        return min([1.0, *intervals])


class ProgressWatchdog:
    """Samples `engine.progress()` (and runs the canary) on a timer; calls `set_serving` only
    when the verdict changes. `is_allowed` says whether it may still publish (False once the
    worker drains: shutdown owns health from then on)."""

    def __init__(self, engine: ProgressSource, config: WatchdogConfig, set_serving: SetServing,
                 is_allowed: Callable[[], bool] = lambda: True) -> None:
        self.engine = engine
        self.config = config
        self._set_serving = set_serving
        self._is_allowed = is_allowed
        self.is_healthy = True
        #: Why the worker is unhealthy, for logs; empty while healthy.
        self.reason = ""
        self._last_steps = -1
        self._last_progress = time.monotonic()
        self._next_canary = 0.0  # the first check runs one
        self._canary_ok = True
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.config.is_enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="watchdog")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            await self.check()

    async def check(self, now: float | None = None) -> bool:
        """One sample; returns whether the engine is healthy (and publishes a change)."""
        now = time.monotonic() if now is None else now
        reason = self._stalled(now)
        if not reason and self.config.canary_interval_s > 0 and now >= self._next_canary:
            self._next_canary = now + self.config.canary_interval_s
            self._canary_ok = await self._canary()
        if not reason and not self._canary_ok:
            reason = "the health canary failed"
        await self._publish(not reason, reason)
        return self.is_healthy

    def _stalled(self, now: float) -> str:
        timeout = self.config.progress_timeout_s
        progress = self.engine.progress()
        if timeout <= 0 or progress is None:
            return ""
        if not progress.has_work or progress.num_steps != self._last_steps:
            self._last_steps = progress.num_steps
            self._last_progress = now
            return ""
        idle = now - self._last_progress
        if idle < timeout:
            return ""
        return f"queued work but no engine step for {idle:.1f} s"

    async def _canary(self) -> bool:
        try:
            await self.engine.health_canary(self.config.canary_timeout_s)
        except Unimplemented:
            log.info("no health canary for this engine; progress alone decides")
            self._next_canary = float("inf")
            return True
        except TandemError as exc:
            log.warning("health canary failed", extra={"error": exc.message})
            return False
        return True

    async def _publish(self, healthy: bool, reason: str) -> None:
        if healthy == self.is_healthy or not self._is_allowed():
            return
        self.is_healthy, self.reason = healthy, reason
        if healthy:
            log.warning("engine makes progress again: SERVING")
        else:
            log.error("engine stuck: NOT_SERVING", extra={"reason": reason})
        await self._set_serving(healthy)
