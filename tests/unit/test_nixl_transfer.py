"""NixlTransfer between real processes: a "prefill" process owns a pool of known random KV and
publishes TransferSources over a pipe; this process (the decode side) reads them with NIXL over
UCX on loopback. Failure tests check that every refused or failed read raises TransferError,
never hangs past its timeout, and leaves the local pool untouched."""
from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import pathlib
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from tandem.engines.types import KvHandle, KvLayout, MemoryDescriptor, RankSource
from tandem.kv.nixl_transfer import NixlTransfer, coalesce
from tandem.kv.transfer import TransferError, TransferSource

#: [layers, K|V, blocks, block_size, kv_heads, head_dim]
SHAPE = (2, 2, 16, 4, 2, 8)
LAYOUT = KvLayout("float32", SHAPE[0], SHAPE[4], SHAPE[5], SHAPE[3])
REGION_BYTES = 4 * 2 * 8 * 4
BLOCK_BYTES = 2 * 2 * REGION_BYTES
STARTUP_S = 60.0


def prefill_pool(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _prefill_main(conn: Connection, seed: int, buffer_blocks: int) -> None:
    """The prefill process: answers block-id lists with (source, checksum) until None. A new
    source ends the one before (its transfer-buffer slot is reused: read only the latest)."""
    transfer = NixlTransfer(prefill_pool(seed), "test-prefill", buffer_blocks=buffer_blocks)
    last = None
    while (block_ids := conn.recv()) is not None:
        if last is not None:
            transfer.end_source(last)
        last = transfer.source(block_ids)
        conn.send((last, transfer.checksum(block_ids)))
    transfer.close()


def _thread_states(pid: int) -> Iterator[str]:
    """The scheduler state letter of each thread of `pid` (from /proc/PID/task/TID/stat,
    "TID (comm) STATE ...", where comm may hold spaces or parentheses)."""
    for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            yield stat.read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # the thread exited meanwhile
            continue


class Prefill:
    """The prefill process; with `buffer_blocks`, its sources are transfer-buffer copies."""

    def __init__(self, seed: int, buffer_blocks: int = 0) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_prefill_main, args=(child, seed, buffer_blocks),
                                       daemon=True)
        self.process.start()
        child.close()
        self.pool = prefill_pool(seed)

    def source(self, block_ids: Sequence[int]) -> tuple[TransferSource, str]:
        self._conn.send(list(block_ids))
        if not self._conn.poll(STARTUP_S):
            raise TimeoutError("the prefill process did not answer")
        return self._conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def signal(self, signum: int) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signum)
        if signum == signal.SIGSTOP:  # delivered asynchronously: wait until every thread stopped
            self._wait_until_stopped(self.process.pid)

    @staticmethod
    def _wait_until_stopped(pid: int) -> None:
        deadline = time.monotonic() + STARTUP_S
        while not all(state == "T" for state in _thread_states(pid)):
            assert time.monotonic() < deadline, "the peer did not stop"
            time.sleep(0.001)

    def stop(self) -> None:
        if self.process.is_alive():
            self._conn.send(None)
            self.process.join(10)
        if self.process.is_alive():
            self.kill()


def handle_for(source: TransferSource, block_ids: Sequence[int], /,
               **changes: object) -> KvHandle:
    handle = KvHandle(
        worker_id="prefill-0", worker_address="127.0.0.1:0", request_id="r0", backend="nixl",
        layout=LAYOUT, num_tokens=len(block_ids) * SHAPE[3], block_ids=tuple(block_ids),
        nixl_agent_name=source.agent_name, nixl_agent_metadata=source.agent_metadata,
        descriptors=source.descriptors, nixl_memory_type=source.memory_type)
    return dataclasses.replace(handle, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prefill() -> Iterator[Prefill]:
    peer = Prefill(seed=1)
    yield peer
    peer.stop()


@pytest.fixture
def decode() -> Iterator[NixlTransfer]:
    transfer = NixlTransfer(torch.zeros(SHAPE), "test-decode")
    yield transfer
    transfer.close()


def assert_only_blocks_written(local: torch.Tensor, expected: dict[int, torch.Tensor]) -> None:
    """`local` holds `expected[block]` in those blocks and zeros everywhere else."""
    for block in range(SHAPE[2]):
        want = expected.get(block, torch.zeros_like(local[:, :, block]))
        assert torch.equal(local[:, :, block], want), f"block {block}"


def test_coalesce_merges_regions_adjacent_on_both_sides() -> None:
    local = np.array([100, 110, 120, 200, 210], dtype=np.uint64)
    remote = np.array([0, 10, 50, 60, 70], dtype=np.uint64)
    devices = np.zeros(5, dtype=np.uint64)
    local_descs, remote_descs = coalesce(local, remote, devices, 10, 0)
    # 100<-0 and 110<-10 merge; 120<-50 breaks on the remote side; 200 breaks on the local side.
    assert local_descs.tolist() == [[100, 20, 0], [120, 10, 0], [200, 20, 0]]
    assert remote_descs.tolist() == [[0, 20, 0], [50, 10, 0], [60, 20, 0]]


def test_source_lists_layer_then_k_v_then_block_regions(decode: NixlTransfer) -> None:
    source = decode.source([5, 2])
    kv = decode.kv_cache
    expected = [kv[layer, kv_index, block].data_ptr()
                for layer in range(SHAPE[0]) for kv_index in (0, 1) for block in (5, 2)]
    assert [d.address for d in source.descriptors] == expected
    assert {d.length for d in source.descriptors} == {REGION_BYTES}
    assert source.memory_type == "DRAM" and decode.block_bytes == BLOCK_BYTES
    assert source.agent_name.startswith(f"test-decode-{os.getpid()}-")


def num_descriptors(decode: NixlTransfer, source: TransferSource, local_ids: list[int]) -> int:
    def addresses(s: TransferSource) -> np.ndarray:
        return np.array([d.address for d in s.descriptors], dtype=np.uint64)
    remote = addresses(source)
    return len(coalesce(addresses(decode.source(local_ids)), remote, np.zeros_like(remote),
                        REGION_BYTES, 0)[0])


@pytest.mark.parametrize(("remote_ids", "local_ids", "descriptors"), [
    # Per (layer, K|V): the run 3-5 -> 10-12, then two single blocks.
    ([3, 4, 5, 9, 0], [10, 11, 12, 2, 7], 4 * 3),
    (list(range(16)), list(range(16)), 1),  # the whole pool
    ([15, 14, 13], [0, 1, 2], 4 * 3),  # contiguous locally only
])
async def test_read_copies_the_blocks_in_order(prefill: Prefill, decode: NixlTransfer,
                                               remote_ids: list[int], local_ids: list[int],
                                               descriptors: int) -> None:
    source, remote_checksum = prefill.source(remote_ids)
    moved = await decode.read(handle_for(source, remote_ids), local_ids, timeout_s=30)
    assert moved == len(remote_ids) * BLOCK_BYTES
    assert decode.checksum(local_ids) == remote_checksum
    assert_only_blocks_written(decode.kv_cache, {
        local: prefill.pool[:, :, remote] for local, remote in zip(local_ids, remote_ids)})
    assert num_descriptors(decode, source, local_ids) == descriptors


async def test_metadata_change_for_a_known_name_is_reloaded(prefill: Prefill,
                                                            decode: NixlTransfer) -> None:
    source, _ = prefill.source([1])
    await decode.read(handle_for(source, [1]), [1], timeout_s=30)
    # Same name, different (garbage) metadata: reloaded, so refused, then the real one works.
    with pytest.raises(TransferError, match="cannot load the NIXL metadata"):
        await decode.read(handle_for(source, [1], nixl_agent_metadata=b"nixl?"), [2], 30)
    await decode.read(handle_for(source, [1]), [3], timeout_s=30)
    assert_only_blocks_written(decode.kv_cache, {b: prefill.pool[:, :, 1] for b in (1, 3)})


def forged(source: TransferSource, kind: str) -> dict[str, object]:
    """KvHandle changes that make a handle for blocks [2, 3] invalid."""
    descriptors = source.descriptors
    pool_bytes = SHAPE[2] * BLOCK_BYTES
    changes: dict[str, dict[str, object]] = {
        "garbage metadata": {"nixl_agent_metadata": b"\x00garbage" * 40},
        "truncated metadata": {"nixl_agent_metadata": source.agent_metadata[:-16]},
        "name not in metadata": {"nixl_agent_name": "someone-else"},
        "no metadata": {"nixl_agent_metadata": b""},
        "one descriptor short": {"descriptors": descriptors[:-1]},
        "one descriptor long": {"descriptors": descriptors[:-1] + (
            dataclasses.replace(descriptors[-1], length=REGION_BYTES * 2),)},
        "all descriptors long": {"descriptors": tuple(
            dataclasses.replace(d, length=REGION_BYTES * 2) for d in descriptors[::2])},
        "outside the peer's memory": {"descriptors": tuple(
            dataclasses.replace(d, address=d.address + pool_bytes) for d in descriptors)},
        "address overflow": {"descriptors": (MemoryDescriptor(2**64, REGION_BYTES),)
                             + descriptors[1:]},
        "unknown memory type": {"nixl_memory_type": "HBM"},
        "three blocks listed": {"block_ids": (2, 3, 4)},
    }
    return changes[kind]


@pytest.mark.parametrize("kind", [
    "garbage metadata", "truncated metadata", "name not in metadata", "no metadata",
    "one descriptor short", "one descriptor long", "all descriptors long",
    "outside the peer's memory", "address overflow", "unknown memory type",
    "three blocks listed"])
async def test_a_forged_handle_is_refused_and_writes_nothing(prefill: Prefill, kind: str) -> None:
    # A fresh agent per case: truncated metadata makes its name unloadable in the agent that
    # tried it (see the module docstring of nixl_transfer).
    decode = NixlTransfer(torch.zeros(SHAPE), "test-decode")
    try:
        source, _ = prefill.source([2, 3])
        with pytest.raises(TransferError):
            await decode.read(handle_for(source, [2, 3], **forged(source, kind)), [5, 6], 30)
        assert_only_blocks_written(decode.kv_cache, {})
    finally:
        decode.close()


@pytest.mark.parametrize("local_ids", [[5, 16], [5, -1], [5, 5], [5]])
async def test_bad_local_block_ids_are_refused(prefill: Prefill, decode: NixlTransfer,
                                               local_ids: list[int]) -> None:
    source, _ = prefill.source([2, 3])
    with pytest.raises(TransferError):
        await decode.read(handle_for(source, [2, 3]), local_ids, timeout_s=30)
    assert_only_blocks_written(decode.kv_cache, {})


async def test_a_tensor_parallel_handle_is_refused_by_one_rank(prefill: Prefill,
                                                                decode: NixlTransfer) -> None:
    source, _ = prefill.source([2, 3])
    shard = RankSource(source.agent_name, source.agent_metadata, source.descriptors)
    with pytest.raises(TransferError, match="same --tensor-parallel-size"):
        await decode.read(handle_for(source, [2, 3], ranks=(shard,)), [0, 1], timeout_s=30)
    assert_only_blocks_written(decode.kv_cache, {})


async def test_a_dead_peer_fails_the_read_quickly(prefill: Prefill, decode: NixlTransfer) -> None:
    early, late = Prefill(seed=2), Prefill(seed=3)
    try:
        never_read, _ = early.source([0, 1])
        read_once, _ = late.source([0, 1])
        await decode.read(handle_for(read_once, [0, 1]), [0, 1], timeout_s=30)
        early.kill()  # before any contact
        late.kill()  # after a read: the connection exists
        for source in (never_read, read_once):
            started = time.monotonic()
            with pytest.raises(TransferError):
                await decode.read(handle_for(source, [0, 1]), [4, 5], timeout_s=10)
            assert time.monotonic() - started < 10
        assert_only_blocks_written(decode.kv_cache, {b: late.pool[:, :, b] for b in (0, 1)})
        # The transfer still serves live peers.
        source, checksum = prefill.source([7])
        await decode.read(handle_for(source, [7]), [9], timeout_s=30)
        assert decode.checksum([9]) == checksum
    finally:
        early.kill()
        late.kill()


@pytest.fixture
async def frozen_peer(
        monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Prefill, KvHandle, NixlTransfer]]:
    """A peer stopped with SIGSTOP after one read, a handle to two of its blocks, and a reader
    over TCP only: there a read needs the peer's progress thread, so it hangs until the peer is
    resumed (over shared memory a stopped process can still be read)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    peer = Prefill(seed=4)
    decode = NixlTransfer(torch.zeros(SHAPE), "test-decode", cancel_grace_s=0.2)
    try:
        warm, _ = peer.source([0])
        await decode.read(handle_for(warm, [0]), [0], timeout_s=30)
        source, _ = peer.source([3, 4])
        peer.signal(signal.SIGSTOP)
        yield peer, handle_for(source, [3, 4]), decode
    finally:
        decode.close()
        peer.kill()


async def test_a_timed_out_or_cancelled_read_writes_nothing_afterwards(
        frozen_peer: tuple[Prefill, KvHandle, NixlTransfer], prefill: Prefill) -> None:
    peer, handle, decode = frozen_peer
    started = time.monotonic()
    with pytest.raises(TransferError, match="took longer than 0.300 s"):
        await decode.read(handle, [8, 9], timeout_s=0.3)
    assert time.monotonic() - started < 0.3 + decode.cancel_grace_s + 2
    # A read on the agent made after the teardown, abandoned by its caller.
    task = asyncio.create_task(decode.read(handle, [10, 11], timeout_s=30))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Resumed, the peer answers both reads; neither may land. No signal marks "nothing more
    # will come", so the test watches for a while.
    peer.signal(signal.SIGCONT)
    await asyncio.sleep(1.0)
    assert_only_blocks_written(decode.kv_cache, {0: peer.pool[:, :, 0]})
    # The transfer goes on with a new agent.
    source, checksum = prefill.source([6])
    await decode.read(handle_for(source, [6]), [12], timeout_s=30)
    assert decode.checksum([12]) == checksum


async def test_a_read_ending_within_the_grace_fails_without_a_reset(
        frozen_peer: tuple[Prefill, KvHandle, NixlTransfer]) -> None:
    peer, handle, decode = frozen_peer
    decode.cancel_grace_s = 30
    agent_name = decode.source([0]).agent_name
    # Resume the peer after the read timed out, inside its grace period. Chained timers: posting
    # the read can block the event loop (NIXL calls are synchronous) past the first delay on a
    # loaded machine, and the peer must still wake only after the read's own timeout.
    loop = asyncio.get_running_loop()
    loop.call_later(0.5, loop.call_later, 0.5, peer.signal, signal.SIGCONT)
    with pytest.raises(TransferError, match="took longer than 0.200 s$"):
        await decode.read(handle, [8, 9], timeout_s=0.2)
    assert decode.source([0]).agent_name == agent_name
    # Late but whole: the bytes landed before the read returned.
    assert_only_blocks_written(decode.kv_cache, {0: peer.pool[:, :, 0], 8: peer.pool[:, :, 3],
                                                 9: peer.pool[:, :, 4]})
