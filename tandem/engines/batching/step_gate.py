"""The batching engine's debug hooks, which fault tests use to stop the step loop at a point
they choose: pause and resume (SIGUSR1 and SIGUSR2 with --debug-hooks), and pause once every
running request has N output tokens (Worker.PauseWhen)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tandem.engines.base import PausePoint

log = logging.getLogger(__name__)


class StepGate:
    """Open unless a hook closed it; the step loop waits on `wait` before each step.

    Args:
        name: the engine's, for the log lines.
        settled: after a step, the point to pause at when the batch is settled (nothing
            waiting, loading or being loaded, something running): (running requests, their
            fewest output tokens); None otherwise.
    """

    def __init__(self, name: str, settled: Callable[[], PausePoint | None]) -> None:
        self.name = name
        self._settled = settled
        self._open = asyncio.Event()
        self._open.set()
        #: pause_when's condition and the future it sets.
        self._pause_at: tuple[int, asyncio.Future[PausePoint]] | None = None

    @property
    def is_armed(self) -> bool:
        """Whether a hook holds the loop or waits for a point to: the engine then runs each step
        in full (never ahead), so that a pause finds every computed token delivered."""
        return not self._open.is_set() or self._pause_at is not None

    async def wait(self) -> None:
        await self._open.wait()

    def pause(self) -> None:
        log.warning("%s engine step loop paused (debug hook)", self.name)
        self._open.clear()

    def resume(self) -> None:
        log.warning("%s engine step loop resumed (debug hook)", self.name)
        self._open.set()

    def release(self) -> None:
        """Opens the gate without a log line (the engine is closing)."""
        self._open.set()

    def pause_when(self, min_output_tokens: int) -> asyncio.Future[PausePoint]:
        if self._pause_at is not None:
            self._pause_at[1].cancel()
        paused: asyncio.Future[PausePoint] = asyncio.get_running_loop().create_future()
        self._pause_at = (min_output_tokens, paused)
        log.warning("%s engine pauses once every request has %d output tokens (debug hook)",
                    self.name, min_output_tokens)
        return paused

    def after_step(self) -> None:
        """Closes the gate if a pause_when condition now holds."""
        if self._pause_at is None:
            return
        min_tokens, paused = self._pause_at
        point = self._settled()
        if point is None or point.min_output_tokens < min_tokens:
            return
        self._pause_at = None
        self.pause()
        if not paused.done():
            paused.set_result(point)
