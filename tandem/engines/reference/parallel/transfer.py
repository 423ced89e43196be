"""Disaggregation between tensor-parallel workers: each rank moves its own shard of the KV heads
to the same rank of the peer, over its own NIXL agent.

Rank 0's `RankedTransfer` is the engine's KvTransfer. `source` describes rank 0's blocks and asks
every follower for its own description of the same blocks (a handle carries them in
`KvHandle.ranks`); `read` has follower r read `ranks[r - 1]` into the same local block ids (all
ranks allocate alike: they follow rank 0's block tables) while rank 0 reads its part, and
returns once every rank's read ended. Followers answer over their pipes; the answers are read
on the event loop (`Replies`), the only thread that asks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from multiprocessing.connection import Connection

from tandem.engines.reference.parallel.mirror import Mirror
from tandem.engines.types import KvHandle
from tandem.kv.transfer import KvTransfer, TransferError, TransferSource

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _RankedSlot:
    """What a composite source holds: rank 0's own source, and each follower's key for its."""

    own: TransferSource
    keys: tuple[int, ...]


class Replies:
    """The followers' answers, matched to the requests that asked (by request id)."""

    def __init__(self, conns: Sequence[Connection]) -> None:
        self.conns = list(conns)
        self._pending: dict[int, asyncio.Future[tuple[object, ...]]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    def new_id(self) -> int:
        return next(self._ids)

    def expect(self, request_id: int) -> asyncio.Future[tuple[object, ...]]:
        """A future for the answer to `request_id`, which the event loop resolves."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            for conn in self.conns:
                loop.add_reader(conn.fileno(), self._readable, conn)
        future: asyncio.Future[tuple[object, ...]] = loop.create_future()
        self._pending[request_id] = future
        return future

    def wait(self, rank: int, request_id: int) -> tuple[object, ...]:
        """Blocks for follower `rank`'s answer to `request_id` (a quick one: the transfer
        buffer's gather); answers to other requests that come first go to their futures."""
        conn = self.conns[rank - 1]
        while True:
            answer: tuple[object, ...] = conn.recv()
            if answer[1] == request_id:
                return answer
            self._resolve(answer)

    def _readable(self, conn: Connection) -> None:
        try:
            while conn.poll():
                self._resolve(conn.recv())
        except (EOFError, OSError):  # the follower died: the rank watch ends the worker
            assert self._loop is not None
            self._loop.remove_reader(conn.fileno())
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(TransferError("a tensor-parallel rank exited"))

    def _resolve(self, answer: tuple[object, ...]) -> None:
        future = self._pending.pop(int(answer[1]), None)  # type: ignore[call-overload]
        if future is not None and not future.done():
            future.set_result(answer)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for conn in self.conns:
                self._loop.remove_reader(conn.fileno())


class RankedTransfer(KvTransfer):
    """Rank 0's KvTransfer: `own` over its shard, the followers' over theirs."""

    backend = "nixl"

    def __init__(self, own: KvTransfer, mirror: Mirror) -> None:
        self.own = own
        self.mirror = mirror
        self.replies = Replies(mirror.conns)
        self.num_followers = len(mirror.conns)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every rank (each holds its share of the heads)."""
        return self.own.block_bytes * (self.num_followers + 1)

    def source(self, block_ids: Sequence[int]) -> TransferSource:
        ids = list(block_ids)
        request_ids = [self.replies.new_id() for _ in range(self.num_followers)]
        for rank, request_id in enumerate(request_ids, start=1):
            self.mirror.send(("source", request_id, ids), rank)
        own = self.own.source(ids)
        parts = []
        for rank, request_id in enumerate(request_ids, start=1):
            _, _, name, metadata, descriptors, memory_type, copied, key = \
                self.replies.wait(rank, request_id)
            parts.append((TransferSource(str(name), metadata, descriptors,  # type: ignore[arg-type]
                                         str(memory_type), bool(copied)), int(key)))  # type: ignore[call-overload]
        return dataclasses.replace(
            own, copied=own.copied and all(part.copied for part, _ in parts),
            slot=_RankedSlot(own, tuple(key for _, key in parts)),
            ranks=tuple(part for part, _ in parts))

    def end_source(self, source: TransferSource) -> None:
        slot = source.slot
        assert isinstance(slot, _RankedSlot)
        self.own.end_source(slot.own)
        for rank, key in enumerate(slot.keys, start=1):
            self.mirror.send(("end_source", key), rank)

    def buffer_stats(self) -> dict[str, int]:
        return self.own.buffer_stats()

    async def read(self, handle: KvHandle, local_block_ids: Sequence[int],
                   timeout_s: float) -> int:
        if len(handle.ranks) != self.num_followers:
            raise TransferError(
                f"the prefill worker's KV comes in {len(handle.ranks) + 1} tensor-parallel "
                f"shard(s), this worker holds {self.num_followers + 1}: both sides need the same "
                "--tensor-parallel-size")
        ids = list(local_block_ids)
        futures = []
        for rank, part in enumerate(handle.ranks, start=1):
            request_id = self.replies.new_id()
            futures.append((request_id, self.replies.expect(request_id)))
            theirs = dataclasses.replace(
                handle, nixl_agent_name=part.nixl_agent_name,
                nixl_agent_metadata=part.nixl_agent_metadata, descriptors=part.descriptors,
                ranks=())
            self.mirror.send(("read", request_id, theirs, ids, timeout_s), rank)
        try:
            moved = await self.own.read(dataclasses.replace(handle, ranks=()), ids, timeout_s)
        except BaseException:
            # Nothing may write into the blocks once this raises: stop the followers' reads
            # (a cancelled read tears its agent down) and wait for their ends.
            for rank, (request_id, _) in enumerate(futures, start=1):
                self.mirror.send(("cancel_read", request_id), rank)
            await asyncio.shield(asyncio.gather(*(f for _, f in futures),
                                                return_exceptions=True))
            raise
        answers = await asyncio.shield(asyncio.gather(*(f for _, f in futures),
                                                      return_exceptions=True))
        for rank, answer in enumerate(answers, start=1):
            if isinstance(answer, BaseException):
                raise TransferError(f"rank {rank}'s read failed: {answer}") from answer
            _, _, rank_moved, error = answer
            if error:
                raise TransferError(f"rank {rank}'s read failed: {error}")
            moved += int(rank_moved)  # type: ignore[call-overload]
        return moved

    def checksum(self, block_ids: Sequence[int]) -> str:
        """Rank 0's shard only (the debug checksums compare the two sides rank 0 to rank 0)."""
        return self.own.checksum(block_ids)

    def close(self) -> None:
        self.replies.close()
        self.own.close()
