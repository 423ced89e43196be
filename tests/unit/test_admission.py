"""Frontend admission control: bounded in-flight slots and a bounded FIFO queue in front of
them; refusals are Overloaded (429), waits end at the deadline, and nothing leaks."""
from __future__ import annotations

import asyncio
import time

import pytest

from tandem.errors import DeadlineExceeded, Overloaded
from tandem.frontend.admission import Admission


async def _hold(admission: Admission, release: asyncio.Event, order: list[int], i: int,
                deadline: float | None = None) -> None:
    async with admission.slot(deadline):
        order.append(i)
        await release.wait()


def test_slots_then_queue_then_refusal_and_fifo() -> None:
    async def run() -> None:
        admission = Admission(max_in_flight=2, max_queued=2)
        release = asyncio.Event()
        order: list[int] = []
        tasks = [asyncio.create_task(_hold(admission, release, order, i)) for i in range(4)]
        await asyncio.sleep(0)
        assert (admission.num_in_flight, admission.num_queued) == (2, 2)
        with pytest.raises(Overloaded):
            async with admission.slot():
                pass
        release.set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3]
        assert (admission.num_in_flight, admission.num_queued) == (0, 0)

    asyncio.run(run())


def test_deadline_and_cancel_free_the_queue() -> None:
    async def run() -> None:
        admission = Admission(max_in_flight=1, max_queued=1)
        release = asyncio.Event()
        order: list[int] = []
        holder = asyncio.create_task(_hold(admission, release, order, 0))
        await asyncio.sleep(0)
        with pytest.raises(DeadlineExceeded):
            await _hold(admission, release, order, 1, deadline=time.monotonic() + 0.05)
        waiter = asyncio.create_task(_hold(admission, release, order, 2))
        await asyncio.sleep(0)
        assert admission.num_queued == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert admission.num_queued == 0
        release.set()
        await holder
        async with admission.slot():  # the slot really came back
            assert admission.num_in_flight == 1
        assert (admission.num_in_flight, admission.num_queued, order) == (0, 0, [0])

    asyncio.run(run())


def test_no_limit_counts_only() -> None:
    async def run() -> None:
        admission = Admission()
        async with admission.slot(), admission.slot():
            assert admission.num_in_flight == 2
        assert admission.num_in_flight == 0

    asyncio.run(run())


def test_a_slot_handed_to_a_waiter_that_leaves_goes_to_the_next() -> None:
    async def run() -> None:
        admission = Admission(max_in_flight=1, max_queued=2)
        order: list[int] = []
        release = asyncio.Event()
        held = admission.slot()
        await held.__aenter__()
        first = asyncio.create_task(_hold(admission, release, order, 1))
        second = asyncio.create_task(_hold(admission, release, order, 2))
        await asyncio.sleep(0)
        assert admission.num_queued == 2
        await held.__aexit__(None, None, None)  # hands the slot to `first` without yielding
        first.cancel()  # it leaves before it ran: the slot must not be lost with it
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0)
        assert order == [2] and admission.num_in_flight == 1
        release.set()
        await second
        assert (admission.num_in_flight, admission.num_queued) == (0, 0)

    asyncio.run(run())
