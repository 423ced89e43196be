"""Turns a scheduled step into model inputs: flattened token ids and positions, the attention
metadata over the paged KV cache, and which rows of the output to sample."""
from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import torch
import torch.nn.functional as F

from tandem.engines.batching.request import BatchRequest
from tandem.engines.batching.scheduler import StepPlan
from tandem.engines.reference.batch import AttentionMetadata, DecodePart
from tandem.engines.reference.encoder import MultimodalSpan


class TokenSpan(Sequence[int]):
    """A read-only window of a request's token list, so that building a step costs nothing per
    context token (the sampler reads only the length unless penalties need the tokens). Stable
    while the step runs: tokens are appended only on the event loop, after the step."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._tokens[self._start:self._stop][index]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._tokens[self._start + index % len(self)]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, self._stop)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    #: Rows of the flattened batch whose logits the ready requests sample from (plan.ready
    #: order): each request's last row, preceded by one row per proposed token it verifies.
    sample_rows: torch.Tensor
    #: Requests wanting prompt logprobs: (request, first row, first position, row count, k).
    prompt_spans: list[tuple[BatchRequest, int, int, int, int]]
    #: Multimodal rows computed this step, with the request each belongs to.
    mm_spans: list[tuple[BatchRequest, MultimodalSpan]] = field(default_factory=list)
    #: When every sequence has one new token: [4, S] rows input_ids, positions, slot_mapping,
    #: context lens (views of one tensor, so a CUDA graph takes them in one copy); else None.
    decode_rows: torch.Tensor | None = None


def build_step_inputs(plan: StepPlan, block_size: int, device: torch.device,
                      decode_width: Callable[[int], int] | None = None) -> StepInputs:
    """Reads the requests' state now (on the event loop), so the forward pass can run in a
    worker thread without touching scheduler state. `decode_width`: the table width a mixed
    step's decodes are padded to (DecodeGraphs.width_bucket), given the step's width."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    tables: list[list[int]] = []
    last_row: dict[int, int] = {}
    prompt_spans: list[tuple[BatchRequest, int, int, int, int]] = []
    mm_spans: list[tuple[BatchRequest, MultimodalSpan]] = []
    for req, n in plan.scheduled:
        end = req.num_computed
        start = end - n
        k = req.sampling.prompt_logprobs
        # num_output > 0: a recompute after preemption; the prompt logprobs were already sent.
        if k is not None and start < req.num_prompt - 1 and req.num_output == 0:
            # Rows at positions start..stop-1 predict prompt tokens start+1..stop.
            stop = min(end, req.num_prompt - 1)
            prompt_spans.append((req, len(token_ids), start, stop - start, k))
        blocks = req.table.block_ids
        for item in req.embeddings:
            # A chunk boundary may cut an item: place only the rows of this step's positions.
            lo = max(start, item.placeholder_offset)
            hi = min(end, item.placeholder_offset + item.num_tokens)
            if lo < hi:
                mm_spans.append((req, MultimodalSpan(len(token_ids) + lo - start, item,
                                                     lo - item.placeholder_offset, hi - lo)))
        token_ids.extend(req.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(blocks[p // block_size] * block_size + p % block_size
                     for p in range(start, end))
        # A verify pass's positions attend as one-token sequences each: position p over the
        # first p + 1 tokens (a step writes every new token's KV before attending, so the
        # proposals before p are there). A step of decodes and verify passes is then a decode
        # step, and takes the decode CUDA graphs.
        ends = range(start + 1, end + 1) if req.num_draft and n == req.num_draft + 1 else (end,)
        for seq_end in ends:
            query_start.append(len(token_ids) - end + seq_end)
            context_lens.append(seq_end)
            tables.append(list(blocks[:(seq_end + block_size - 1) // block_size]))
        last_row[id(req)] = len(token_ids) - 1
    width = max((len(t) for t in tables), default=1)
    rows = [row for req in plan.ready
            for row in range(last_row[id(req)] - req.num_draft, last_row[id(req)] + 1)]
    sizes = [b - a for a, b in zip(query_start, query_start[1:])]
    is_decode_only = all(size == 1 for size in sizes)
    # A mixed step's one-token sequences (decodes beside prompt chunks): attended in one batch.
    singles = [] if is_decode_only else [s for s, size in enumerate(sizes) if size == 1]
    if len(singles) < 2:
        singles = []
    # One host-to-device copy for every index tensor of the step (each copy costs the host
    # ~10 us, which a batch-1 decode step on a GPU pays in full); the tensors are views of it.
    # Gathered in an int64 array: torch.tensor of a list costs ~0.1 us per element (0.25 ms
    # for the 2,500 values of 64 sequences of 1,000 tokens, 0.07 ms through the array, on a
    # development VM). Pinned on CUDA: a copy from pageable memory may wait for the stream,
    # and a step launched ahead (batching.ahead) is built while the previous one computes.
    # Each part starts 16 bytes into the copy (an even count of int64 before it): Triton
    # compiles a kernel per 16-byte alignment of its pointers, so a part at an odd offset (an
    # odd token count before it) would compile variants on a request's step (jit_watch).
    parts = (token_ids, positions, slots, context_lens, rows, singles,
             [query_start[s] for s in singles])
    pads = [[0] * (len(part) & 1) for part in parts]
    values = array.array("q", itertools.chain(
        *itertools.chain.from_iterable(zip(parts, pads)),
        *(t + [0] * (width - len(t)) for t in tables)))
    flat = torch.frombuffer(values, dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    views = flat.split([*(len(part) + len(pad) for part, pad in zip(parts, pads)),
                        len(tables) * width])
    ids_t, positions_t, slots_t, context_t, rows_t, singles_t, single_rows_t = (
        view[:len(part)] for view, part in zip(views, parts))
    tables_t = views[-1]
    num_seqs = len(context_lens)
    stride = num_seqs + (num_seqs & 1)
    decode_rows = (flat[:4 * stride].view(4, stride)[:, :num_seqs] if is_decode_only
                   else None)
    block_tables = tables_t.view(len(tables), width)
    decode_part = None
    if singles:
        decode_part = DecodePart(single_rows_t, AttentionMetadata(
            slot_mapping=slots_t.index_select(0, single_rows_t), query_start_loc=[],
            context_lens=[context_lens[s] for s in singles],
            context_lens_t=context_t.index_select(0, singles_t),
            block_tables=_padded(block_tables.index_select(0, singles_t),
                                 decode_width(width) if decode_width else width),
            block_size=block_size,
            is_decode_only=True), frozenset(singles))
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        query_start_loc=query_start,
        context_lens=context_lens,
        context_lens_t=context_t,
        block_tables=block_tables,
        block_size=block_size,
        is_decode_only=is_decode_only,
        decode_part=decode_part,
    )
    return StepInputs(ids_t, positions_t, meta, rows_t, prompt_spans, mm_spans, decode_rows)


def _padded(tables: torch.Tensor, width: int) -> torch.Tensor:
    """`tables` [S, w] widened to `width` columns of block 0 (masked by the context lengths)."""
    return F.pad(tables, (0, width - tables.shape[1])) if width > tables.shape[1] else tables
