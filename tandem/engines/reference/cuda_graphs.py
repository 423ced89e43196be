"""CUDA graphs of pure decode steps, which on a GPU are bound by kernel launches, not math.

One graph per (batch bucket, block-table width bucket), all captured when the engine starts
(`capture_all`, before the worker reports SERVING: a capture, and the kernel compiles and tunes
of its first run, take seconds that no request should wait for), replayed from static input
buffers. Batches are padded up to their bucket with rows that write their K/V into
a scratch block outside the pool (the KV tensor's last block) and attend only to it, so padding
never touches a real block. Widths are bucketed too because decode attention gathers the whole
table width: a graph for the model's maximum width would read far more than the batch needs.

MoE models are captured when their decode step has no host sync (DecoderModel.decode_syncs):
gpt-oss in half precision, whose routing, expert sort and grouped GEMMs run on the device with
shapes set by the token count alone (moe_kernels). Padding rows are routed like real ones, so
they may add experts to a step's reads, never change a real row's result.
"""
from __future__ import annotations

import torch

from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.model import DecoderModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class DecodeGraphs:
    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, max_batch: int,
                 max_width: int) -> None:
        device = kv_cache.device
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        #: The KV tensor's last block: written and read only by padding rows.
        self.scratch_block = kv_cache.shape[2] - 1
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        widths, w = [], 4
        while w < max_width:
            widths.append(w)
            w *= 2
        self.width_buckets = (*widths, max_width)
        max_batch, max_width = self.batch_buckets[-1], self.width_buckets[-1]
        # Rows input ids, positions, slots, context lens: StepInputs.decode_rows' layout.
        self.rows = torch.zeros(4, max_batch, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self.rows
        self.block_tables = torch.zeros(max_batch, max_width, dtype=torch.long, device=device)
        #: A padding row's column of `rows`: token 0 at position 0, its K/V in the scratch block.
        self._pad_column = torch.tensor([[0], [0], [self.scratch_block * self.block_size], [1]],
                                        device=device)
        self._pad_rows(0, max_batch, max_width)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _pad_rows(self, start: int, stop: int, width: int) -> None:
        self.rows[:, start:stop] = self._pad_column
        self.block_tables[start:stop, :width] = self.scratch_block

    def buckets(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """The graph shape serving this step, or None when it is beyond every bucket."""
        b = _bucket(num_seqs, self.batch_buckets)
        w = _bucket(width, self.width_buckets)
        return None if b is None or w is None else (b, w)

    def run(self, rows: torch.Tensor, block_tables: torch.Tensor,
            shape: tuple[int, int]) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode step, through the graph of `shape`: `rows`
        [4, num_seqs] as StepInputs.decode_rows, `block_tables` [num_seqs, width]. The returned
        tensor is the graph's output buffer: read it before the next step."""
        b, w = shape
        n, width = block_tables.shape
        self.rows[:, :n].copy_(rows)  # one copy: ids, positions, slots, context lens
        self.block_tables[:n, :width].copy_(block_tables)
        if width < w:
            self.block_tables[:n, width:w] = self.scratch_block  # masked; finite values
        if n < b:
            self._pad_rows(n, b, w)
        entry = self.graphs.get(shape)
        if entry is None:
            entry = self.graphs[shape] = self._capture(b, w)
        graph, logits = entry
        graph.replay()
        return logits[:n]

    def capture_all(self) -> int:
        """Captures every bucket's graph now, so that no kernel compiles, tunes or is captured
        on a request's step. An eager step's decodes (those of a mixed step) pad their tables
        to a width bucket (`width_bucket`), so the decode kernel's split count, a compile-time
        constant, is one these captures compiled. Returns the graph count."""
        for b in self.batch_buckets:
            for w in self.width_buckets:
                if (b, w) not in self.graphs:
                    self.graphs[(b, w)] = self._capture(b, w)
        torch.cuda.synchronize()
        return len(self.graphs)

    def width_bucket(self, width: int) -> int:
        """The width a table of `width` blocks is padded to (itself beyond every bucket)."""
        return _bucket(width, self.width_buckets) or width

    def _forward(self, b: int, w: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=list(range(b + 1)),
            context_lens=[1] * b, context_lens_t=self.context_lens[:b],
            block_tables=self.block_tables[:b, :w], block_size=self.block_size,
            is_decode_only=True)
        hidden = self.model(self.input_ids[:b], self.positions[:b], meta, self.kv_cache)
        return self.model.compute_logits(hidden)

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (as torch requires before capture), then capture. Both runs
        # use the current static inputs, whose padding rows only touch the scratch block.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(b, w)
        return graph, logits
