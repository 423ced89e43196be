"""The KV transfer buffer: its slot allocator, its layout, and NIXL reads through it between
real processes (a prompt whose blocks are scattered in both pools moves with ONE descriptor, the
bytes land exactly in the blocks asked for, and every slot comes back, also after a failure)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tandem.kv.nixl_transfer import NixlTransfer, _Agent
from tandem.kv.transfer import TransferError
from tandem.kv.transfer_buffer import Slot, TransferBuffer, slot_region_addresses
from tests.unit.test_nixl_transfer import (
    BLOCK_BYTES,
    REGION_BYTES,
    SHAPE,
    Prefill,
    assert_only_blocks_written,
    handle_for,
    prefill_pool,
)

SCATTERED = [9, 2, 14, 5]


# ---- the allocator --------------------------------------------------------------------------

def test_slots_are_first_fit_and_merge_when_given_back() -> None:
    buffer = TransferBuffer(torch.zeros(SHAPE), 10)
    a, b, c = buffer.take(3), buffer.take(4), buffer.take(3)
    assert (a, b, c) == (Slot(0, 3), Slot(3, 4), Slot(7, 3))
    assert buffer.take(1) is None and buffer.num_free == 0
    buffer.give(a)
    assert buffer.take(4) is None  # 3 free blocks, not 4
    buffer.give(c)
    assert buffer.take(4) is None  # two runs of 3, not adjacent
    buffer.give(b)  # merges 0-3, 3-7 and 7-10 into one run
    assert buffer.num_free == 10 and buffer.num_taken == 0
    assert buffer.take(10) == Slot(0, 10)


def test_a_slot_given_back_twice_is_an_error() -> None:
    buffer = TransferBuffer(torch.zeros(SHAPE), 4)
    slot = buffer.take(2)
    assert slot is not None
    buffer.give(slot)
    with pytest.raises(AssertionError, match="returned twice"):
        buffer.give(slot)
    with pytest.raises(AssertionError):
        buffer.give(Slot(3, 2))  # past the end


def test_a_slot_is_laid_out_in_descriptor_order() -> None:
    buffer = TransferBuffer(torch.zeros(SHAPE), 8)
    slot = buffer.take(3)
    assert slot is not None and buffer.take(2) == Slot(3, 2)
    slot2 = Slot(3, 2)
    view = buffer.view(slot2)
    assert view.shape == (SHAPE[0], 2, 2, *SHAPE[3:]) and view.is_contiguous()
    expected = [view[layer, kv, j].data_ptr()
                for layer in range(SHAPE[0]) for kv in (0, 1) for j in range(2)]
    assert buffer.region_addresses(slot2).tolist() == expected
    assert buffer.address(slot2) == buffer.tensor.data_ptr() + 3 * BLOCK_BYTES
    assert slot_region_addresses(1000, 2, SHAPE[0], REGION_BYTES).tolist() == [
        1000 + i * REGION_BYTES for i in range(2 * SHAPE[0] * 2)]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the device runs it)"))]


@pytest.mark.parametrize("device", DEVICES)
async def test_gather_then_scatter_moves_exactly_the_blocks(device: str) -> None:
    pool = prefill_pool(3).to(device)
    buffer = TransferBuffer(pool, 8)
    slot = buffer.take(len(SCATTERED))
    assert slot is not None
    buffer.gather(slot, SCATTERED)
    assert torch.equal(buffer.view(slot), pool[:, :, SCATTERED])
    target = TransferBuffer(torch.zeros(SHAPE, device=device), 8)
    landing = target.take(len(SCATTERED))
    assert landing is not None
    target.view(landing).copy_(buffer.view(slot))
    await target.scatter(landing, [1, 0, 7, 3])
    assert_only_blocks_written(target.kv_cache, {
        local: pool[:, :, remote] for local, remote in zip([1, 0, 7, 3], SCATTERED)})


# ---- reads between processes ----------------------------------------------------------------

@pytest.fixture(scope="module")
def buffered_prefill() -> Iterator[Prefill]:
    peer = Prefill(seed=2, buffer_blocks=8)
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def plain_prefill() -> Iterator[Prefill]:
    peer = Prefill(seed=4)
    yield peer
    peer.stop()


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of descriptors of every READ posted in this test."""
    counts: list[int] = []
    post_read = _Agent.post_read

    def counting(self: _Agent, local: np.ndarray, remote: np.ndarray, memory_type: str,
                 peer: str) -> int:
        counts.append(len(local))
        return post_read(self, local, remote, memory_type, peer)
    monkeypatch.setattr(_Agent, "post_read", counting)
    return counts


def test_a_buffered_source_is_one_descriptor_and_frees_its_slot() -> None:
    transfer = NixlTransfer(prefill_pool(5), "test-source", buffer_blocks=6)
    try:
        assert transfer.buffer is not None
        source = transfer.source(SCATTERED)
        assert source.copied and len(source.descriptors) == 1
        (whole,) = source.descriptors
        assert whole.length == len(SCATTERED) * BLOCK_BYTES
        assert whole.address == transfer.buffer.tensor.data_ptr()
        assert transfer.buffer.num_free == 2
        too_big = transfer.source(list(range(3)))  # 3 blocks, 2 free: region by region
        assert not too_big.copied and len(too_big.descriptors) == 3 * 2 * SHAPE[0]
        transfer.end_source(too_big)  # holds no slot: nothing changes
        transfer.end_source(source)
        assert transfer.buffer.num_free == 6
    finally:
        transfer.close()


@pytest.mark.parametrize(("source_buffered", "reader_blocks", "descriptors", "buffered_reads"), [
    (True, 8, 1, 1),  # both sides copy: one descriptor however scattered the blocks are
    (True, 0, 2 * SHAPE[0] * len(SCATTERED), 0),  # the reader has no buffer: its blocks
    (False, 8, 2 * SHAPE[0] * len(SCATTERED), 1),  # the source went region by region
    (True, 2, 2 * SHAPE[0] * len(SCATTERED), 0),  # the prompt does not fit the reader's
])
async def test_reads_through_the_buffer_land_exactly(
        buffered_prefill: Prefill, plain_prefill: Prefill, posted: list[int],
        source_buffered: bool, reader_blocks: int, descriptors: int,
        buffered_reads: int) -> None:
    peer = buffered_prefill if source_buffered else plain_prefill
    decode = NixlTransfer(torch.zeros(SHAPE), "test-decode", buffer_blocks=reader_blocks)
    local_ids = [3, 11, 0, 6]
    try:
        source, remote_checksum = peer.source(SCATTERED)
        assert source.copied is source_buffered
        moved = await decode.read(handle_for(source, SCATTERED), local_ids, timeout_s=30)
        assert moved == len(SCATTERED) * BLOCK_BYTES
        assert decode.checksum(local_ids) == remote_checksum
        assert_only_blocks_written(decode.kv_cache, {
            local: peer.pool[:, :, remote] for local, remote in zip(local_ids, SCATTERED)})
        assert posted == [descriptors]
        assert decode.buffer_stats() == {
            "kv_transfer_buffer_blocks_used": 0, "kv_transfer_buffer_blocks_total": reader_blocks,
            "kv_reads_buffered": buffered_reads, "kv_reads_by_region": 1 - buffered_reads}
    finally:
        decode.close()


@pytest.mark.parametrize("kind", ["short", "long", "outside"])
async def test_a_forged_buffer_handle_is_refused_and_frees_the_slot(
        buffered_prefill: Prefill, kind: str) -> None:
    decode = NixlTransfer(torch.zeros(SHAPE), "test-decode", buffer_blocks=8)
    try:
        source, _ = buffered_prefill.source([2, 3])
        (whole,) = source.descriptors
        changed = {"short": dataclasses.replace(whole, length=whole.length - 1),
                   "long": dataclasses.replace(whole, length=whole.length + BLOCK_BYTES),
                   "outside": dataclasses.replace(whole, address=whole.address + 2**30)}[kind]
        with pytest.raises(TransferError):
            await decode.read(handle_for(source, [2, 3], descriptors=(changed,)), [5, 6], 30)
        assert_only_blocks_written(decode.kv_cache, {})
        assert decode.buffer is not None and decode.buffer.num_free == 8
    finally:
        decode.close()


async def test_a_dead_peer_fails_a_buffered_read_and_frees_the_slot() -> None:
    peer = Prefill(seed=6, buffer_blocks=4)
    decode = NixlTransfer(torch.zeros(SHAPE), "test-decode", buffer_blocks=4)
    try:
        source, _ = peer.source([1, 2])
        peer.kill()
        with pytest.raises(TransferError):
            await decode.read(handle_for(source, [1, 2]), [4, 5], timeout_s=30)
        assert_only_blocks_written(decode.kv_cache, {})
        assert decode.buffer is not None and decode.buffer.num_free == 4
    finally:
        decode.close()
        peer.stop()
