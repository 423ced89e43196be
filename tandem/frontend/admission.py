"""Frontend admission control: a bound on the requests the frontend holds, so that overload ends
in a clear, retryable refusal (429 with Retry-After / RESOURCE_EXHAUSTED) rather than in
unbounded waits and memory.

At most `max_in_flight` requests are sent on to workers at once; up to `max_queued` more wait,
first come first served, for one of those slots; one more is refused at once. A waiting request
whose deadline passes ends with DeadlineExceeded; one whose client leaves gives up its place.
"""
from __future__ import annotations

import asyncio
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
        self.num_queued = 0
        self._slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None

    def has_room(self) -> bool:
        """Whether a request arriving now would be admitted or queued (not refused)."""
        if self._slots is None:
            return True
        is_free = self.num_in_flight < self.max_in_flight and not self.num_queued
        return is_free or self.num_queued < self.max_queued

    @contextlib.asynccontextmanager
    async def slot(self, deadline: float | None = None) -> AsyncIterator[None]:
        """Holds one in-flight slot for the body's duration.

        Args:
            deadline: time.monotonic() by which the request must have a slot; None: no limit.
        Raises:
            Overloaded: every slot is taken and the queue is full.
            DeadlineExceeded: the deadline passed while the request waited.
        """
        slots = self._slots
        if slots is None:
            self.num_in_flight += 1
            try:
                yield
            finally:
                self.num_in_flight -= 1
            return
        if not self.has_room():
            raise Overloaded(f"the frontend is at capacity ({self.max_in_flight} requests in "
                             f"flight, {self.num_queued} queued); retry later")
        self.num_queued += 1
        try:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                await asyncio.wait_for(slots.acquire(), timeout)
            except TimeoutError:
                raise DeadlineExceeded("the request's deadline passed while it waited for the "
                                       "frontend's capacity") from None
        finally:
            self.num_queued -= 1
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            slots.release()
