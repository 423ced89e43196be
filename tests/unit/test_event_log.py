from __future__ import annotations

import asyncio

import pytest

from tandem.engines.types import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.kv.event_log import EventLog


def stored(hashes: tuple[int, ...], parent: int | None, bs: int = 2) -> BlockStored:
    tokens = tuple(range(len(hashes) * bs))
    return BlockStored(hashes, parent, tokens, bs)


def snapshot_hashes(log: EventLog) -> list[int]:
    return [b.block_hashes[0] for b in log.snapshot()[1]]


def test_sequence_numbers_start_at_one_and_skip_empty_batches() -> None:
    log = EventLog()
    assert log.last_sequence == 0
    assert log.append([stored((1,), None)]) == 1
    assert log.append([]) == 1
    assert log.append([stored((2,), 1), BlockRemoved((1,))]) == 2
    assert log.last_sequence == 2


def test_since_replays_and_reports_the_future_as_empty() -> None:
    log = EventLog()
    a, b, c = [stored((1,), None)], [stored((2,), 1)], [BlockRemoved((2,))]
    for batch in (a, b, c):
        log.append(batch)
    assert log.since(1) == [(1, tuple(a)), (2, tuple(b)), (3, tuple(c))]
    assert log.since(0) == log.since(1)
    assert log.since(3) == [(3, tuple(c))]
    assert log.since(4) == []
    assert EventLog().since(1) == []


def test_since_asks_for_resync_once_batches_were_dropped() -> None:
    log = EventLog(capacity=3)
    for h in range(1, 6):
        log.append([stored((h,), None)])
    assert log.oldest_sequence == 3
    assert log.since(2) is None
    assert log.since(1) is None
    assert [seq for seq, _ in log.since(3)] == [3, 4, 5]


def test_snapshot_follows_stored_removed_and_cleared() -> None:
    log = EventLog(capacity=1)  # the snapshot must not depend on retained batches
    log.append([BlockStored((10, 11, 12), None, tuple(range(6)), 2)])
    seq, blocks = log.snapshot()
    assert seq == 1
    assert blocks == [BlockStored((10,), None, (0, 1), 2), BlockStored((11,), 10, (2, 3), 2),
                      BlockStored((12,), 11, (4, 5), 2)]
    log.append([BlockRemoved((12,)), stored((20,), 11)])
    assert snapshot_hashes(log) == [10, 11, 20]
    log.append([AllBlocksCleared()])
    assert log.snapshot() == (3, [])
    log.append([stored((30,), None)])
    assert snapshot_hashes(log) == [30]


def test_snapshot_puts_parents_before_children_after_a_parent_is_restored() -> None:
    log = EventLog()
    log.append([stored((1, 2), None)])
    log.append([BlockRemoved((1,))])  # parent evicted before its child
    log.append([stored((1,), None)])  # and stored again later
    log.append([stored((3,), 2)])
    assert snapshot_hashes(log) == [1, 2, 3]


def test_rejects_non_events_and_bad_capacity() -> None:
    with pytest.raises(ValueError):
        EventLog(capacity=0)
    with pytest.raises(TypeError):
        EventLog().append(["not an event"])  # type: ignore[list-item]


async def test_wait_beyond_wakes_on_append_without_polling() -> None:
    log = EventLog()
    log.append([stored((1,), None)])
    await asyncio.wait_for(log.wait_beyond(0), 1)  # already beyond: returns at once
    waiter = asyncio.ensure_future(log.wait_beyond(1))
    await asyncio.sleep(0)  # let the waiter start and block
    assert not waiter.done()
    log.append([])  # an empty batch is not progress
    await asyncio.sleep(0)
    assert not waiter.done()
    log.append([stored((2,), 1)])
    await asyncio.wait_for(waiter, 1)
    # two waiters on different targets
    w3 = asyncio.ensure_future(log.wait_beyond(3))
    w2 = asyncio.ensure_future(log.wait_beyond(2))
    log.append([stored((3,), 2)])
    await asyncio.wait_for(w2, 1)
    assert not w3.done()
    log.append([stored((4,), 3)])
    await asyncio.wait_for(w3, 1)
