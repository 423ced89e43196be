"""Frontend admission control: a bound on the requests the frontend holds, so that overload ends
in a clear, retryable refusal (429 with Retry-After / RESOURCE_EXHAUSTED) rather than in
unbounded waits and memory.

At most `max_in_flight` requests are sent on to workers at once; up to `max_queued` more wait,
first come first served, for one of those slots; one more is refused at once. A waiting request
whose deadline passes ends with DeadlineExceeded; one whose client leaves gives up its place.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator

from tandem.errors import DeadlineExceeded, Overloaded


class Admission:
    def __init__(self, max_in_flight: int = 0, max_queued: int = 0) -> None:
        """`max_in_flight` 0: no limit (and no queue)."""
        if max_in_flight < 0 or max_queued < 0:
            raise ValueError("admission limits must be >= 0")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.num_in_flight = 0
        #: Requests waiting for a slot, first come first served; a slot freed goes to the
        #: first one still waiting (its future's result set), never back to the count.
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    def has_room(self) -> bool:
        """Whether a request arriving now would be admitted or queued (not refused)."""
        if not self.max_in_flight:
            return True
        is_free = self.num_in_flight < self.max_in_flight and not self._waiting
        return is_free or len(self._waiting) < self.max_queued

    @contextlib.asynccontextmanager
    async def slot(self, deadline: float | None = None) -> AsyncIterator[None]:
        """Holds one in-flight slot for the body's duration.

        Args:
            deadline: time.monotonic() by which the request must have a slot; None: no limit.
        Raises:
            Overloaded: every slot is taken and the queue is full.
            DeadlineExceeded: the deadline passed while the request waited.
        """
        if self.max_in_flight and (self.num_in_flight >= self.max_in_flight or self._waiting):
            await self._wait_for_slot(deadline)  # counted in flight by the releaser
        else:
            self.num_in_flight += 1
        try:
            yield
        finally:
            self._release()

    async def _wait_for_slot(self, deadline: float | None) -> None:
        if not self.has_room():
            raise Overloaded(f"the frontend is at capacity ({self.max_in_flight} requests in "
                             f"flight, {self.num_queued} queued); retry later")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            await asyncio.wait_for(waiter, timeout)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot came as it gave up: pass it on
            else:
                waiter.cancel()
                self._waiting.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded("the request's deadline passed while it waited for the "
                                       "frontend's capacity") from None
            raise

    def _release(self) -> None:
        """A slot is free: the first waiter takes it (still in flight), else the count drops."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_in_flight -= 1
