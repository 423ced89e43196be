"""Prefill-side KV leases: a prefilled prompt's blocks stay pinned for its decode worker until it
has read them (and called Release) or the lease runs out.

Runs on the engine's event loop (expiry is a loop timer), so releasing and expiring never race
the scheduler. Freed blocks keep their prefix-cache hashes: a lease that ends is a cache entry,
not lost work.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.kv.block_pool import BlockTable


@dataclass(slots=True)
class Lease:
    table: BlockTable
    #: Unix epoch milliseconds after which the blocks may be reused.
    expiry_unix_ms: int
    timer: asyncio.TimerHandle
    #: Frees what the lease holds beside its blocks (a transfer buffer slot), if anything.
    on_end: Callable[[], None] | None = None


class LeaseTable:
    """Leased block tables by request id.

    Contract: every table handed to `add` is given back to `free_blocks` exactly once (and its
    `on_end` called once, after): by `release`, by its expiry timer, or by `close`. A lease
    whose blocks were copied out for the transfer holds an empty table and its copy.
    """

    def __init__(self, free_blocks: Callable[[BlockTable], None]) -> None:
        self._free_blocks = free_blocks
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0
        self.num_released = 0
        #: Called after blocks return to the pool (the engine wakes its step loop).
        self.on_freed: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.table) for lease in self._leases.values())

    def add(self, request_id: str, table: BlockTable, lease_ms: int,
            on_end: Callable[[], None] | None = None) -> int:
        """Takes ownership of `table` (and of what `on_end` frees) for `lease_ms`; returns the
        expiry (Unix ms)."""
        if request_id in self._leases:
            raise ValueError(f"request '{request_id}' already holds a lease")
        loop = asyncio.get_running_loop()
        expiry = int(time.time() * 1000) + lease_ms
        timer = loop.call_later(lease_ms / 1000, self._expire, request_id)
        self._leases[request_id] = Lease(table, expiry, timer, on_end)
        return expiry

    def release(self, request_id: str) -> bool:
        """Frees a lease early; False when no live lease has that id."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        lease.timer.cancel()
        self.num_released += 1
        self._give_back(lease)
        return True

    def _expire(self, request_id: str) -> None:
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self.num_expired += 1
            self._give_back(lease)

    def _give_back(self, lease: Lease) -> None:
        self._free(lease)
        if self.on_freed is not None:
            self.on_freed()

    def close(self) -> None:
        """Frees every lease (engine shutdown)."""
        for request_id in list(self._leases):
            lease = self._leases.pop(request_id)
            lease.timer.cancel()
            self._free(lease)

    def _free(self, lease: Lease) -> None:
        self._free_blocks(lease.table)
        if lease.on_end is not None:
            lease.on_end()
