"""The reference engine's host KV tier memory and the copies between it and the paged KV cache.

Host layout: one tensor `[slot, layer, K|V, offset_in_block, kv_head, head_dim]`, so that a
slot (one block of every layer) is one contiguous run of bytes: a single DMA per block each
way. On CUDA it is pinned and the copies run on a copy stream of their own: device blocks are
gathered into (or scattered from) a contiguous staging buffer on the GPU, and each block
crosses the bus as one non-blocking copy. The compute stream waits on an event recorded after
the copies, so the host thread never waits for them (unless asked: a NIXL read is about to
write device blocks) and their timings are read from CUDA events once they have completed. On
CPU the tier is a second tensor and the copies are synchronous.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from tandem.engines.batching.host_copies import CopyTiming


class HostKvStore:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        num_layers, two, _, block_size, num_kv_heads, head_size = kv_cache.shape
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.is_cuda = kv_cache.is_cuda
        self.host = torch.zeros((num_slots, num_layers, two, block_size, num_kv_heads, head_size),
                                dtype=kv_cache.dtype, pin_memory=self.is_cuda)
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        #: CUDA: (kind, blocks, start event, end event) of copies issued, oldest first.
        self._in_flight: deque[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = deque()
        #: finished() runs in the copying thread and on the loop (stats).
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def copy(self, offloads: Sequence[tuple[int, int]], onboards: Sequence[tuple[int, int]],
             sync: bool) -> list[CopyTiming]:
        """Offloads (device block, host slot), then onboards (host slot, device block); runs in
        a worker thread. Returns the timings of copies known to have finished."""
        if not self.is_cuda:
            return self._copy_cpu(offloads, onboards)
        self._copy_cuda(offloads, onboards, sync)
        return self.finished()

    def _copy_cpu(self, offloads: Sequence[tuple[int, int]], onboards: Sequence[tuple[int, int]]
                  ) -> list[CopyTiming]:
        timings: list[CopyTiming] = []
        kv, host = self.kv_cache, self.host
        if offloads:
            started = time.perf_counter()
            blocks = torch.tensor([b for b, _ in offloads])
            slots = torch.tensor([s for _, s in offloads])
            host.index_copy_(0, slots, kv.index_select(2, blocks).permute(2, 0, 1, 3, 4, 5))
            timings.append(("offload", len(offloads), time.perf_counter() - started))
        if onboards:
            started = time.perf_counter()
            slots = torch.tensor([s for s, _ in onboards])
            blocks = torch.tensor([b for _, b in onboards])
            kv.index_copy_(2, blocks, host.index_select(0, slots).permute(1, 2, 0, 3, 4, 5))
            timings.append(("onboard", len(onboards), time.perf_counter() - started))
        return timings

    def _copy_cuda(self, offloads: Sequence[tuple[int, int]],
                   onboards: Sequence[tuple[int, int]], sync: bool) -> None:
        stream = self.stream
        assert stream is not None
        compute = torch.cuda.current_stream(self.device)
        kv, host = self.kv_cache, self.host
        # The blocks to offload were last written by earlier forward passes.
        # Index tensors go over before the timed region and without a host sync: a pageable
        # copy inside it would leave the stream idle while the host builds the next one.
        offload_blocks = self._indices([b for b, _ in offloads])
        onboard_blocks = self._indices([b for _, b in onboards])
        stream.wait_stream(compute)
        for indices in (offload_blocks, onboard_blocks):
            indices.record_stream(stream)  # made on the compute stream, used on this one
        with torch.cuda.stream(stream):
            if offloads:
                start, end = _event(), _event()
                start.record(stream)
                staging = kv.index_select(2, offload_blocks).permute(2, 0, 1, 3, 4, 5).contiguous()
                for i, (_, slot) in enumerate(offloads):
                    host[slot].copy_(staging[i], non_blocking=True)
                end.record(stream)
                with self._lock:
                    self._in_flight.append(("offload", len(offloads), start, end))
            if onboards:
                staging = torch.empty((len(onboards), *host.shape[1:]), dtype=host.dtype,
                                      device=self.device)
                start, end = _event(), _event()
                start.record(stream)
                for i, (slot, _) in enumerate(onboards):
                    staging[i].copy_(host[slot], non_blocking=True)
                kv.index_copy_(2, onboard_blocks, staging.permute(1, 2, 0, 3, 4, 5))
                end.record(stream)
                with self._lock:
                    self._in_flight.append(("onboard", len(onboards), start, end))
        # Staging buffers were allocated on the copy stream, which alone uses them: the
        # caching allocator reuses their memory only for later work on that stream.
        compute.wait_stream(stream)
        if sync:
            stream.synchronize()

    def _indices(self, values: list[int]) -> torch.Tensor:
        """`values` on the device through pinned memory (no host sync)."""
        return torch.tensor(values, dtype=torch.long).pin_memory().to(self.device,
                                                                      non_blocking=True)

    def finished(self) -> list[CopyTiming]:
        """Timings of CUDA copies that have completed since the last call (never blocks)."""
        done: list[CopyTiming] = []
        with self._lock:
            while self._in_flight and self._in_flight[0][3].query():
                kind, blocks, start, end = self._in_flight.popleft()
                done.append((kind, blocks, start.elapsed_time(end) / 1000.0))
        return done


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)
