"""A step's prompt chunks attended in one flash-attention call per layer (CUDA, half precision).

`attention.prefill_attention` loops over a step's sequences: per layer and sequence a gather of
its blocks, a GQA repeat and a flash call, ~10 kernels. At 41 prompts of 200 tokens that is
~13,000 launches a step on the 8B shape, more host time than the device's ~230 ms of compute, so
a burst's prefill stretches with whatever else the host does (issue 25). Here the step gathers
every prompt sequence's context once per layer through one token index built once per step
(`VarlenPrefill`), and torch's flash attention takes them all at once, each sequence's keys in
`cum_seq_k` (variable length, as FlashAttention-2's varlen kernel; its causal mask is aligned
to the bottom right, so a chunk after a cached prefix sees that prefix). GQA goes in as it is:
the kernel maps each query head to its KV head. Sequences of the step's decode part
(`AttentionMetadata.decode_part`) are left to the decode path, as in the loop.
"""
from __future__ import annotations

import array

import torch

from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.varlen_layout import VarlenPrefill


def serves(q: torch.Tensor, sliding_window: int | None, sinks: torch.Tensor | None,
           meta: AttentionMetadata) -> bool:
    """Whether `flash_prefill` computes this step's prompt chunks: CUDA, half precision, a
    head size flash attention takes, no sinks, and no sliding window narrower than a context."""
    head_size = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and sinks is None
            and head_size % 8 == 0 and head_size <= 256
            and (sliding_window is None or max(meta.context_lens) <= sliding_window))


def build_layout(meta: AttentionMetadata, device: torch.device) -> VarlenPrefill:
    """The step's prompt sequences for flash attention: their rows, context slots and
    cumulative lengths (one host-to-device copy)."""
    skip = meta.decode_part.seqs if meta.decode_part is not None else frozenset()
    seqs = [s for s in range(meta.num_seqs) if s not in skip]
    lens_q = [meta.query_start_loc[s + 1] - meta.query_start_loc[s] for s in seqs]
    lens_k = [meta.context_lens[s] for s in seqs]
    # One host-to-device copy (pinned on CUDA: a pageable one may wait for the stream).
    values = array.array("q", seqs)
    for s in seqs:
        values.extend(range(meta.query_start_loc[s], meta.query_start_loc[s + 1]))
    for lens in (lens_q, lens_k):
        values.append(0)
        for n in lens:
            values.append(values[-1] + n)
    host = torch.frombuffer(values, dtype=torch.long)
    flat = (host.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
            else host.to(device))
    p = len(seqs)
    seqs_t, rows, cum_q, cum_k = flat.split([p, sum(lens_q), p + 1, p + 1])
    slots = _context_slots(meta, seqs_t if p < meta.num_seqs else None, sum(lens_k), cum_k)
    return VarlenPrefill(rows, slots, cum_q.to(torch.int32), cum_k.to(torch.int32),
                         max(lens_q), max(lens_k), p == meta.num_seqs)


def _context_slots(meta: AttentionMetadata, seqs: torch.Tensor | None, total: int,
                   cum_k: torch.Tensor) -> torch.Tensor:
    """Each prompt sequence's context positions 0..len-1 as flat KV slots, computed on the
    device (no host loop over context tokens: a cached prefix may be long). `seqs`: the prompt
    sequences' indices, None when they are all the step's."""
    tables = meta.block_tables if seqs is None else meta.block_tables.index_select(0, seqs)
    device = cum_k.device
    seq = torch.repeat_interleave(torch.arange(tables.shape[0], device=device),
                                  torch.diff(cum_k), output_size=total)
    pos = torch.arange(total, device=device) - cum_k[:-1].index_select(0, seq)
    bs = meta.block_size
    return tables[seq, pos // bs] * bs + pos % bs


def flash_prefill(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                  out: torch.Tensor) -> None:
    """Writes the attention of the step's prompt rows of q [T, heads, D] into `out`."""
    varlen = meta.varlen
    if varlen is None:
        varlen = meta.varlen = build_layout(meta, q.device)
    kv_heads, head_size = kv_layer.shape[-2], kv_layer.shape[-1]
    k = kv_layer[0].view(-1, kv_heads, head_size).index_select(0, varlen.slots)
    v = kv_layer[1].view(-1, kv_heads, head_size).index_select(0, varlen.slots)
    qs = q if varlen.all_rows else q.index_select(0, varlen.rows)
    o = torch.ops.aten._flash_attention_forward(
        qs, k.to(q.dtype), v.to(q.dtype), varlen.cum_q, varlen.cum_k, varlen.max_q,
        varlen.max_k, 0.0, True, False)[0]
    if varlen.all_rows:
        out.copy_(o)
    else:
        out.index_copy_(0, varlen.rows, o)
