"""What makes the ranks past the first follow rank 0: each model call rank 0 makes is first sent
to them, as a small header over a pipe (the Python-side shape of the call) and its tensors by one
broadcast on the tensor-parallel group, then run by every rank on its own shard.

Commands come from two threads: the step's (forward, logits, host copies) and the event loop's
(the KV transfer's, parallel/transfer.py); one lock keeps each message whole and in order.

The broadcast runs on the group's device stream, so a decode step launched ahead
(overlap scheduling), whose input ids are the previous step's tokens copied on the device, sends
its followers those ids in stream order with no host sync. The calls come from one thread at a
time (the engine computes one step at a time: a step launched ahead is settled before the next
runs in full), and every rank runs them in the order rank 0 sent them, so the ranks' collectives
always pair up.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from tandem.engines.reference.batch import AttentionMetadata, DecodePart
from tandem.engines.reference.parallel.group import TensorGroup


@dataclass(frozen=True)
class PartHeader:
    """A mixed step's one-token sequences (batch.DecodePart) without their tensors."""

    num_rows: int
    width: int
    context_lens: list[int]
    seqs: frozenset[int]


@dataclass(frozen=True)
class StepHeader:
    """A forward call without its tensors: the Python-side fields of AttentionMetadata and the
    sizes of the int64 tensors that one broadcast carries, in this order: input ids [T],
    positions [T], KV slots [T], context lengths [S], block tables [S, W]; then, for a mixed
    step's decode part, its rows [D], slots [D], context lengths [D] and tables [D, W']."""

    num_tokens: int
    width: int
    query_start_loc: list[int]
    context_lens: list[int]
    block_size: int
    is_decode_only: bool
    part: PartHeader | None


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> tuple[StepHeader, torch.Tensor]:
    """(header, flat int64 tensor on the step's device) of one forward call."""
    tensors = [input_ids, positions, meta.slot_mapping, meta.context_lens_t,
               meta.block_tables.reshape(-1)]
    part_header = None
    part = meta.decode_part
    if part is not None:
        tables = part.meta.block_tables
        part_header = PartHeader(part.rows.shape[0], tables.shape[1],
                                 list(part.meta.context_lens), part.seqs)
        tensors += [part.rows, part.meta.slot_mapping, part.meta.context_lens_t,
                    tables.reshape(-1)]
    header = StepHeader(input_ids.shape[0], meta.block_tables.shape[1],
                        list(meta.query_start_loc), list(meta.context_lens), meta.block_size,
                        meta.is_decode_only, part_header)
    return header, torch.cat([t.to(torch.long) for t in tensors])


def packed_size(header: StepHeader) -> int:
    seqs = len(header.context_lens)
    size = 3 * header.num_tokens + seqs + seqs * header.width
    part = header.part
    if part is not None:
        size += 3 * part.num_rows + part.num_rows * part.width
    return size


def unpack_step(header: StepHeader, flat: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The forward call's (input ids, positions, metadata) from its header and tensor."""
    tokens, seqs, width = header.num_tokens, len(header.context_lens), header.width
    sizes = [tokens, tokens, tokens, seqs, seqs * width]
    part = header.part
    if part is not None:
        sizes += [part.num_rows] * 3 + [part.num_rows * part.width]
    views = flat.split(sizes)
    input_ids, positions, slots, context_t, tables = views[:5]
    decode_part = None
    if part is not None:
        rows, part_slots, part_context, part_tables = views[5:]
        decode_part = DecodePart(rows, AttentionMetadata(
            slot_mapping=part_slots, query_start_loc=[], context_lens=part.context_lens,
            context_lens_t=part_context, block_tables=part_tables.view(part.num_rows, part.width),
            block_size=header.block_size, is_decode_only=True), part.seqs)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=header.query_start_loc,
        context_lens=header.context_lens, context_lens_t=context_t,
        block_tables=tables.view(seqs, width), block_size=header.block_size,
        is_decode_only=header.is_decode_only, decode_part=decode_part)
    return input_ids, positions, meta


class Mirror:
    """Rank 0's side: sends each call to every follower (`conns`, one pipe each), then
    broadcasts the call's tensors."""

    def __init__(self, conns: Sequence[Connection], tp: TensorGroup) -> None:
        self.conns = list(conns)
        self.tp = tp
        self._lock = threading.Lock()

    def send(self, command: tuple[object, ...], rank: int | None = None) -> None:
        """Sends `command` to follower `rank` (1..), or to every follower."""
        with self._lock:
            for conn in self.conns if rank is None else [self.conns[rank - 1]]:
                conn.send(command)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> None:
        """Before rank 0's DecoderModel.forward: the followers run theirs on the same step."""
        header, flat = pack_step(input_ids, positions, meta)
        self.send(("forward", header))
        self.tp.broadcast(flat)

    def logits(self, hidden: torch.Tensor) -> None:
        """Before rank 0's compute_logits: the followers project the same rows onto their
        part of the vocabulary."""
        self.send(("logits", tuple(hidden.shape)))
        self.tp.broadcast(hidden.contiguous())

    def copy_blocks(self, offloads: Sequence[tuple[int, int]],
                    onboards: Sequence[tuple[int, int]], sync: bool) -> None:
        """Before rank 0's host-tier copies: the followers copy the same blocks of theirs."""
        self.send(("copy", list(offloads), list(onboards), sync))
