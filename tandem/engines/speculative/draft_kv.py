"""The paged KV of a proposer that runs a model of its own (a draft model, an EAGLE-3 head).

Its cache is paged like the target's and addressed through the SAME block tables (vLLM's
layout for draft KV): position p of a request lives in block `table[p // block_size]` of both
caches, so it needs no allocator of its own; the engine reserves the blocks its proposals write
before it proposes (`Proposer.writes_kv`), and a block the target frees is forgotten by the
draft too. This module turns one draft forward's spans into model inputs over that cache and
says when a request's draft KV survived a table change.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.proposer import Proposer

#: One request's rows of a draft forward: its tokens and the position of the first.
Span = tuple[Sequence[int], int]


@dataclass
class DraftBatch:
    """The inputs of one draft forward over several requests' spans."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    #: [S] the row of each span's last token (whose output guesses the next token).
    last_rows: torch.Tensor


def draft_batch(spans: Sequence[Span], tables: Sequence[Sequence[int]], block_size: int,
                device: torch.device) -> DraftBatch:
    """The inputs of a forward over each (tokens, first position) span, writing K/V through
    the request's block ids `tables[i]` (which cover every position of the span)."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, lens = [0], []
    for (toks, start), blocks in zip(spans, tables, strict=True):
        end = start + len(toks)
        ids.extend(toks)
        positions.extend(range(start, end))
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        starts.append(len(ids))
        lens.append(end)
    width = max(-(-n // bs) for n in lens)
    padded = [list(blocks[:-(-n // bs)]) + [0] * (width - -(-n // bs))
              for blocks, n in zip(tables, lens, strict=True)]

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots), query_start_loc=starts, context_lens=lens,
        context_lens_t=tensor(lens), block_tables=tensor(padded), block_size=bs,
        is_decode_only=all(len(t) == 1 for t, _ in spans))
    return DraftBatch(tensor(ids), tensor(positions), meta, tensor([s - 1 for s in starts[1:]]))


@dataclass(slots=True)
class DraftKv:
    """How far one request's draft KV is valid, and through which blocks it was written."""

    #: Leading positions whose draft KV is valid.
    computed: int = 0
    #: The block ids that KV was written through (a change means the blocks were replaced).
    blocks: list[int] = field(default_factory=list)

    def check_blocks(self, blocks: Sequence[int], block_size: int) -> None:
        """Forgets the KV if the blocks holding it are no longer the request's (`blocks`):
        preemption frees and replaces them."""
        used = -(-self.computed // block_size)
        if list(blocks[:used]) != list(self.blocks[:used]):
            self.computed = 0


class PagedDraftProposer(Proposer):
    """A proposer that computes with a model of its own over its own paged KV cache (the
    draft model, the EAGLE-3 head): run off the event loop, its blocks reserved first."""

    computes = True
    writes_kv = True

    def __init__(self, config: SpeculativeConfig, kv_cache: torch.Tensor, device: torch.device,
                 block_size: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = block_size
