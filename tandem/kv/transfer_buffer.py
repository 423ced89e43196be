"""The transfer buffer: a registered tensor where a prompt's KV blocks sit contiguous, so that a
NIXL READ moves them with ONE descriptor whatever their place in the pool.

The pool is kv_cache[layer, K|V, block, offset, kv_head, head_dim], so a block is 2 * layers
regions apart from each other, and blocks that are not neighbours in the pool cost a descriptor
per (layer, K|V, block): 2,048 of 64 KiB for a 1,000-token prompt of the Llama-3.1-8B shape,
which UCX moves at ~6 GB/s over NVLink against ~260 GB/s for one descriptor (issue 40). The
prefill side gathers a leased prompt's blocks into a slot here (one index_select), the decode
side reads the whole slot into a slot of its own and scatters it into the blocks it allocated
(one index_copy_). A slot of n blocks is laid out [layer, K|V, n, offset, kv_head, head_dim]:
the pool's descriptor order, so region (l, kv, j) of a slot sits at
`base + ((2 * l + kv) * n + j) * region_bytes` on both sides (`slot_region_addresses`).

Slots are whole blocks, handed out first fit from a free list; a prompt that does not fit goes
block by block (the caller's fallback). Used from one event loop; the copies run on a side
stream on CUDA (the pool's blocks they touch belong to no step in flight: the prefill side's
are final once their first token was sampled, the decode side's are not scheduled before the
scatter has finished).
"""
from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

#: Polling backoff while a scatter runs on the device: yield at once, then double up to this.
_MAX_POLL_S = 5e-4


@dataclass(frozen=True, slots=True)
class Slot:
    """`num_blocks` blocks of the buffer from block `start` on."""

    start: int
    num_blocks: int


def slot_region_addresses(base: int, num_blocks: int, num_layers: int,
                          region_bytes: int) -> np.ndarray:
    """Start addresses (uint64) of a slot's (layer, K|V, block) regions in descriptor order:
    layer-major, K before V, then the blocks. A slot is contiguous in exactly this order, so
    the addresses are `base` plus multiples of `region_bytes`."""
    count = 2 * num_layers * num_blocks
    return (np.arange(count, dtype=np.uint64) * np.uint64(region_bytes)) + np.uint64(base)


class TransferBuffer:
    """Contiguous slots of KV blocks beside a pool, of its dtype and on its device.

    Args:
        kv_cache: the pool, [num_layers, 2, num_blocks, block_size, H, D].
        num_blocks: capacity in blocks (at least 1).
    """

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a transfer buffer needs at least one block, got {num_blocks}")
        self.kv_cache = kv_cache
        self.num_layers = kv_cache.shape[0]
        self._region_shape = tuple(kv_cache.shape[3:])
        self.region_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.block_bytes = 2 * self.num_layers * self.region_bytes
        self.capacity = num_blocks
        block_numel = 2 * self.num_layers * kv_cache[0, 0, 0].numel()
        self.tensor = torch.empty(num_blocks * block_numel, dtype=kv_cache.dtype,
                                  device=kv_cache.device)
        self._block_numel = block_numel
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        #: Free runs as (start, length), sorted by start, never adjacent (merged on return).
        self._free: list[tuple[int, int]] = [(0, num_blocks)]
        self.num_taken = 0

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)

    # ---- slots ----------------------------------------------------------------------------

    def take(self, num_blocks: int) -> Slot | None:
        """A slot of `num_blocks` blocks, first fit; None when no free run is that long."""
        if num_blocks < 1:
            return None
        for i, (start, length) in enumerate(self._free):
            if length >= num_blocks:
                if length == num_blocks:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_blocks, length - num_blocks)
                self.num_taken += num_blocks
                return Slot(start, num_blocks)
        return None

    def give(self, slot: Slot) -> None:
        """Returns a slot taken from this buffer (exactly once)."""
        run = (slot.start, slot.num_blocks)
        i = bisect.bisect_left(self._free, run)
        before = self._free[i - 1] if i > 0 else None
        after = self._free[i] if i < len(self._free) else None
        end = slot.start + slot.num_blocks
        if (before is not None and before[0] + before[1] > slot.start) or (
                after is not None and after[0] < end) or end > self.capacity:
            raise AssertionError(f"slot {slot} overlaps free space: returned twice?")
        start, length = run
        if after is not None and after[0] == end:
            length += after[1]
            del self._free[i]
        if before is not None and before[0] + before[1] == start:
            start, length = before[0], before[1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, length))
        self.num_taken -= slot.num_blocks

    def view(self, slot: Slot) -> torch.Tensor:
        """The slot as [num_layers, 2, num_blocks, block_size, H, D]."""
        begin = slot.start * self._block_numel
        flat = self.tensor[begin:begin + slot.num_blocks * self._block_numel]
        return flat.view(self.num_layers, 2, slot.num_blocks, *self._region_shape)

    def address(self, slot: Slot) -> int:
        return self.tensor.data_ptr() + slot.start * self.block_bytes

    def region_addresses(self, slot: Slot) -> np.ndarray:
        return slot_region_addresses(self.address(slot), slot.num_blocks, self.num_layers,
                                     self.region_bytes)

    # ---- copies ---------------------------------------------------------------------------

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        # Made on the copy's stream (inside its context): on the default stream the index
        # upload would queue behind the step in flight.
        return torch.as_tensor(list(block_ids), dtype=torch.long, device=self.kv_cache.device)

    def gather(self, slot: Slot, block_ids: Sequence[int]) -> None:
        """Copies pool blocks `block_ids` (in order) into `slot`; finished when it returns."""
        if self._stream is None:
            torch.index_select(self.kv_cache, 2, self._ids(block_ids), out=self.view(slot))
            return
        with torch.cuda.stream(self._stream):
            torch.index_select(self.kv_cache, 2, self._ids(block_ids), out=self.view(slot))
        # Short (a 131 MB prompt: well under a millisecond) and the handle may not go out
        # before it: a peer's READ does not wait for this process's streams.
        self._stream.synchronize()

    async def scatter(self, slot: Slot, block_ids: Sequence[int]) -> None:
        """Copies `slot` into pool blocks `block_ids` (in order); finished when it returns.
        Awaits the device without blocking the loop."""
        if self._stream is None:
            self.kv_cache.index_copy_(2, self._ids(block_ids), self.view(slot))
            return
        with torch.cuda.stream(self._stream):
            self.kv_cache.index_copy_(2, self._ids(block_ids), self.view(slot))
            done = torch.cuda.Event()
            done.record(self._stream)
        delay = 0.0
        try:
            while not done.query():
                await asyncio.sleep(delay)
                delay = min(max(2 * delay, 5e-5), _MAX_POLL_S)
        except asyncio.CancelledError:
            done.synchronize()  # the caller frees the slot and the blocks once this returns
            raise
