"""Moving a prefilled prompt's KV blocks from a prefill worker's pool into a decode worker's.

A `KvTransfer` belongs to one engine and knows its KV memory. The prefill side describes leased
blocks (`source`), the decode side pulls them into blocks it allocated (`read`). Reads are
one-sided: the prefill worker's engine takes no part, and the decode side releases the lease
afterwards (Prefill.Release). Backends: "nixl" (tandem.kv.nixl_transfer, real bytes over UCX)
and "mock" (SimulatedTransfer: block accounting and a modelled transfer time, no bytes).
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engines.types import KvHandle, MemoryDescriptor


class TransferError(Exception):
    """A read did not complete (peer gone, bad descriptors, timeout). When it is raised, the
    transfer has been cancelled and nothing writes into the local blocks any more."""


@dataclass(frozen=True, slots=True)
class TransferSource:
    """What a KV handle must carry for a peer to read some blocks (see KvHandle in
    common.proto)."""

    agent_name: str = ""
    agent_metadata: bytes = b""
    descriptors: tuple[MemoryDescriptor, ...] = ()
    memory_type: str = ""
    #: The blocks' bytes were copied into a transfer buffer (tandem.kv.transfer_buffer): the
    #: pool blocks may be freed at once, and `KvTransfer.end_source` frees the copy.
    copied: bool = False
    #: The transfer's own record of the copy (None: the descriptors point into the pool).
    slot: object = None
    #: A tensor-parallel worker's ranks past the first: each rank's shard, described alike.
    ranks: tuple[TransferSource, ...] = ()


class KvTransfer(ABC):
    #: The KvHandle.backend value this transfer produces and reads.
    backend: str = ""

    @property
    @abstractmethod
    def block_bytes(self) -> int:
        """Bytes of one KV block (every layer, K and V)."""

    @abstractmethod
    def source(self, block_ids: Sequence[int]) -> TransferSource:
        """Describes local blocks (in prompt order) for a peer to read."""

    def buffer_stats(self) -> dict[str, int]:
        """The transfer buffer's EngineStats fields (kv_transfer_buffer_blocks_used, ...);
        none without a buffer."""
        return {}

    def end_source(self, source: TransferSource) -> None:  # noqa: B027 (nothing by default)
        """The peer is done with `source` (read, released or expired): frees what `source`
        holds beside the pool blocks. Called exactly once per source."""

    @abstractmethod
    async def read(self, handle: KvHandle, local_block_ids: Sequence[int],
                   timeout_s: float) -> int:
        """Copies the handle's blocks, in order, into `local_block_ids` (same count); returns
        the bytes moved.

        Raises:
            TransferError: the read failed or took longer than `timeout_s`; the local blocks
                are no longer being written when this is raised.
        """

    @abstractmethod
    def checksum(self, block_ids: Sequence[int]) -> str:
        """Hex digest of the blocks' bytes, in order (tests compare both sides with it)."""

    def close(self) -> None:  # noqa: B027  (most transfers hold nothing to release)
        """Releases registrations and connections."""


class SimulatedTransfer(KvTransfer):
    """The mock engine's transfer: no bytes, a delay of bytes / bandwidth."""

    backend = "mock"

    def __init__(self, block_bytes: int, gbps: float) -> None:
        self._block_bytes = block_bytes
        self.gbps = gbps

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def source(self, block_ids: Sequence[int]) -> TransferSource:
        return TransferSource()

    async def read(self, handle: KvHandle, local_block_ids: Sequence[int],
                   timeout_s: float) -> int:
        if len(handle.block_ids) != len(local_block_ids):
            raise TransferError(f"the handle lists {len(handle.block_ids)} blocks, "
                                f"{len(local_block_ids)} were allocated for them")
        moved = len(local_block_ids) * self._block_bytes
        delay = moved / (self.gbps * 1e9) if self.gbps > 0 else 0.0
        if delay > timeout_s:
            await asyncio.sleep(timeout_s)
            raise TransferError(f"simulated transfer of {moved} bytes outlasted {timeout_s} s")
        await asyncio.sleep(delay)
        return moved

    def checksum(self, block_ids: Sequence[int]) -> str:
        return ""
