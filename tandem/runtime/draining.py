"""A service's drain state: whether shutdown began, and the request RPCs still in flight.

The server (tandem.runtime.server) begins the drain and waits for it; its interceptor and the
servicers read it.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class Draining:
    """A flag servicers check to refuse new work once shutdown began (UNAVAILABLE), and the
    count of request RPCs in flight that shutdown waits for."""

    def __init__(self) -> None:
        self.active = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        #: Set while a request is in flight or once the drain began (see wait_for_work).
        self._working = asyncio.Event()

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """One more request in flight (pair with leave(); tracking() does both)."""
        self.num_in_flight += 1
        self._idle.clear()
        self._working.set()

    def leave(self) -> None:
        self.num_in_flight -= 1
        if not self.num_in_flight:
            self._idle.set()
            if not self.active:
                self._working.clear()

    def begin(self) -> None:
        """Shutdown began: servicers refuse new work from now on."""
        self.active = True
        self._working.set()

    async def wait_for_work(self, timeout_s: float) -> None:
        """Returns once a request is in flight or the drain began, or after `timeout_s` (for
        periodic work that has nothing to do while the service is idle)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._working.wait(), timeout_s)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no request RPC is in flight (now or within `timeout_s`)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
