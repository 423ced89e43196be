"""The reference engine's host KV tier memory and the copies between it and the paged KV cache.

Host layout: one tensor `[slot, layer, K|V, offset_in_block, kv_head, head_dim]`, so that a
slot (one block of every layer) is one contiguous run of bytes. On CUDA it is pinned, and a
step's offloads, then its onboards, are one Triton kernel each on a copy stream of their own:
it reads the source blocks and writes the destination blocks in place, the host side through
the pinned memory's device address (UVA), so each byte crosses the bus once, with no staging
buffer and no scatter/gather pass. On the lent H100 (PCIe 5) that moves a step's blocks at
~0.9x one plain pinned copy of the same bytes, each way. The per-block DMAs through a device
staging buffer that it replaces reached 0.83-0.88x once warm, but their first copy each way
ran at 6-11 GB/s (index kernels loaded lazily, staging allocated inside the timed region);
benchmarks/RESULTS.md, "Host KV tier", and benchmarks/probes/host_copy_probe.py. The kernel runs on
SMs: beside a forward pass it would get ~0.6x where the copy engines' DMAs keep ~0.87x, but
here a step's copies and its forward pass never overlap. It is compiled (both directions) when
the store is made, so that no timed copy includes a compile. The compute stream waits on an
event recorded after the copies, so the host thread never waits for them (unless asked: a NIXL
read is about to write device blocks) and their timings are read from CUDA events once they
have completed. On CPU the tier is a second tensor and the copies are synchronous.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from tandem.engines.batching.host_copies import CopyTiming
from tandem.engines.reference.build import as_bytes

try:  # Triton ships with CUDA builds of PyTorch; CPU builds (and CI) have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Words per program of the copy kernel (16 KiB of 32-bit words: enough loads in flight per
#: SM to keep the bus busy).
WORDS_PER_PROGRAM = 4096


class HostKvStore:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        num_layers, two, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
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
        if self.is_cuda:
            if triton is None:
                raise RuntimeError("the CUDA host KV tier needs Triton (CUDA builds of torch "
                                   "ship it)")
            # A block is `rows` runs of `row_words` words, one per layer and K|V; a word is
            # 4 bytes where the rows allow it (16-byte loads).
            row_bytes = block_size * num_kv_heads * head_size * kv_cache.element_size()
            word = next(w for w in (torch.int32, torch.int16, torch.uint8)
                        if row_bytes % w.itemsize == 0)
            self._rows, self._row_words = num_layers * two, row_bytes // word.itemsize
            self._device_words = kv_cache.view(-1).view(word)
            self._host_words = self.host.view(-1).view(word)
            self._host_strides = (self._rows * self._row_words, self._row_words)
            self._device_strides = (self._row_words, num_blocks * self._row_words)
            # Compiles the kernel for both directions outside any timed copy: block 0 goes to
            # the free slot 0 and back, unchanged.
            self._copy_cuda([(0, 0)], [(0, 0)], sync=True)
            self.finished()

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
        kv, host = as_bytes(self.kv_cache), as_bytes(self.host)
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
        # The blocks to offload were last written by earlier forward passes.
        indices = self._indices(offloads, onboards)
        off_blocks, off_slots = indices[0, :len(offloads)], indices[1, :len(offloads)]
        on_slots, on_blocks = indices[2, :len(onboards)], indices[3, :len(onboards)]
        stream.wait_stream(compute)
        indices.record_stream(stream)  # made on the compute stream, used on this one
        device, host = (self._device_words, self._device_strides), (self._host_words,
                                                                     self._host_strides)
        with torch.cuda.stream(stream):
            if offloads:
                self._timed("offload", off_blocks, device, off_slots, host)
            if onboards:
                self._timed("onboard", on_slots, host, on_blocks, device)
        compute.wait_stream(stream)
        if sync:
            stream.synchronize()

    def _indices(self, offloads: Sequence[tuple[int, int]],
                 onboards: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Rows [offload blocks, offload slots, onboard slots, onboard blocks] on the device
        through one pinned copy, issued on the compute stream before the timed region (no host
        sync). Rows are padded to an even length: the kernel is compiled for 16-byte aligned
        index pointers, and a pointer of another alignment would compile it again inside a
        timed copy."""
        width = (max(len(offloads), len(onboards)) + 1) // 2 * 2
        rows = [[b for b, _ in offloads], [s for _, s in offloads], [s for s, _ in onboards],
                [b for _, b in onboards]]
        return torch.tensor([row + [0] * (width - len(row)) for row in rows],
                            dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def _timed(self, kind: str, src_index: torch.Tensor,
               src: tuple[torch.Tensor, tuple[int, int]], dst_index: torch.Tensor,
               dst: tuple[torch.Tensor, tuple[int, int]]) -> None:
        """Copies block src_index[i] of `src` to block dst_index[i] of `dst` on the current
        (copy) stream between two timing events."""
        stream = torch.cuda.current_stream(self.device)
        start, end = _event(), _event()
        start.record(stream)
        copy_blocks(src[0], src[1], src_index, dst[0], dst[1], dst_index, self._rows,
                    self._row_words)
        end.record(stream)
        with self._lock:
            self._in_flight.append((kind, len(src_index), start, end))

    def finished(self) -> list[CopyTiming]:
        """Timings of CUDA copies that have completed since the last call (never blocks)."""
        done: list[CopyTiming] = []
        with self._lock:
            while self._in_flight and self._in_flight[0][3].query():
                kind, blocks, start, end = self._in_flight.popleft()
                done.append((kind, blocks, start.elapsed_time(end) / 1000.0))
        return done


def copy_blocks(src: torch.Tensor, src_strides: tuple[int, int], src_index: torch.Tensor,
                dst: torch.Tensor, dst_strides: tuple[int, int], dst_index: torch.Tensor,
                rows: int, row_words: int, words_per_program: int = WORDS_PER_PROGRAM,
                num_warps: int = 4) -> None:
    """For each i, copies block src_index[i] of `src` to block dst_index[i] of `dst` (flat
    tensors of one word type, on the device or pinned). A block is `rows` runs of `row_words`
    words, its row r at block * block_stride + r * row_stride, (block_stride, row_stride) =
    *_strides. One kernel on the current stream."""
    if not len(src_index):
        return
    width = min(words_per_program, triton.next_power_of_2(row_words))
    grid = (len(src_index), rows, triton.cdiv(row_words, width))
    _copy_blocks_kernel[grid](src, src_index, *src_strides, dst, dst_index, *dst_strides,
                              row_words, WIDTH=width, num_warps=num_warps)


if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(src_ptr, src_index_ptr, src_block_stride, src_row_stride,
                            dst_ptr, dst_index_ptr, dst_block_stride, dst_row_stride,
                            row_words, WIDTH: tl.constexpr):
        i = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        words = tl.program_id(2) * WIDTH + tl.arange(0, WIDTH)
        mask = words < row_words
        src_block = tl.load(src_index_ptr + i).to(tl.int64)
        dst_block = tl.load(dst_index_ptr + i).to(tl.int64)
        x = tl.load(src_ptr + src_block * src_block_stride + row * src_row_stride + words,
                    mask=mask)
        tl.store(dst_ptr + dst_block * dst_block_stride + row * dst_row_stride + words, x,
                 mask=mask)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)
