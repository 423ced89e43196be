"""Self-attention over the paged KV cache, following the contract in `batch.py`.

Two paths, both on torch's scaled_dot_product_attention:
  * `prefill_attention`: any mix of chunks; on CUDA in half precision one flash-attention call
    for every prompt sequence of the step (`varlen`), else one SDPA per sequence (a Python loop
    over S, with no host syncs: every length it needs is already a Python int in
    AttentionMetadata). In a step that mixes prompt chunks with decodes, the one-token
    sequences (`meta.decode_part`) skip it and take the decode path together
    (`mixed_attention`): a loop over 64 decodes beside one prompt chunk cost the 8B shape on an
    H100 most of its mixed-step time.
  * `decode_attention`: every sequence has one new token; all sequences in ONE SDPA over a padded
    gather of their blocks, masked by `context_lens_t`. No loop, no host sync: the GPU decode path.
With attention sinks (gpt-oss) both paths compute the same attention in plain matmuls instead
(`sink_attention`), since SDPA has no place for the sink's extra logit; on CUDA in half
precision a whole prompt takes `sink_prefill` (flash attention, or window-sized chunks) and
decode the Triton kernel (kernels.paged_decode_attention).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from tandem.engines.reference import kernels, varlen
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.build import as_bytes
from tandem.engines.reference.layers import RMSNorm
from tandem.engines.reference.rope import apply_rope
from tandem.engines.reference.spec import ModelSpec


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_size] at flat slots `slot_mapping` [T] of
    kv_layer [2, num_blocks, block_size, kv_heads, head_size]."""
    num_blocks, block_size, kv_heads, head_size = kv_layer.shape[1:]
    flat = kv_layer.view(2, num_blocks * block_size, kv_heads, head_size)
    as_bytes(flat[0]).index_copy_(0, slot_mapping, as_bytes(k.to(kv_layer.dtype)))
    as_bytes(flat[1]).index_copy_(0, slot_mapping, as_bytes(v.to(kv_layer.dtype)))


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention whose denominator also holds exp(sinks[h]), a per-head logit that
    attends to no value, as in gpt-oss (transformers' eager attention, step for step).

    Args:
        q: [B, heads, Tq, D]; k, v: [B, kv_heads, Tk, D] (query head h reads kv head
            h // (heads // kv_heads)).
        mask: bool, broadcastable to [B, heads, Tq, Tk], True where a query sees a key.
        sinks: [heads].
    Returns:
        [B, heads, Tq, D] in q's dtype.
    """
    batch, num_heads, num_queries, head_size = q.shape
    group = num_heads // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * head_size ** -0.5
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.to(q.dtype).reshape(1, -1, 1, 1).expand(batch, -1, num_queries, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs, v)


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                      sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, heads, head_size] (new tokens, grouped by sequence as in
    `meta.query_start_loc`) over each sequence's cached context. The new tokens of a sequence are
    the LAST positions of its context. `sinks` [heads]: attention sinks (`sink_attention`), or
    None. Returns [T, heads, head_size] in q's dtype, written into `out` where given; the rows
    of `meta.decode_part`'s sequences are left unwritten (`mixed_attention` fills them)."""
    out = torch.empty_like(q) if out is None else out
    if varlen.serves(q, sliding_window, sinks, meta):
        varlen.flash_prefill(q, kv_layer, meta, out)  # every prompt sequence at once
        return out
    block_size = meta.block_size
    k_blocks, v_blocks = kv_layer[0], kv_layer[1]
    skip = meta.decode_part.seqs if meta.decode_part is not None else frozenset()
    for s, context_len in enumerate(meta.context_lens):
        if s in skip:
            continue
        start, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        num_new = end - start
        num_blocks = -(-context_len // block_size)
        block_ids = meta.block_tables[s, :num_blocks]
        # [num_blocks, block_size, kv_heads, D] -> [1, kv_heads, context_len, D]
        k = k_blocks[block_ids].flatten(0, 1)[:context_len].transpose(0, 1).unsqueeze(0)
        v = v_blocks[block_ids].flatten(0, 1)[:context_len].transpose(0, 1).unsqueeze(0)
        qs = q[start:end].transpose(0, 1).unsqueeze(0)
        if sinks is not None:
            if _takes_sink_prefill(q, num_new, context_len):
                o = sink_prefill(qs, k, v, sliding_window, sinks)
            else:
                o = sink_attention(qs, k, v, _visible(num_new, context_len, sliding_window,
                                                      q.device), sinks)
            out[start:end] = o.squeeze(0).transpose(0, 1)
            continue
        if q.is_cuda and not _window_matters(context_len, sliding_window):
            o = _causal_on_cuda(qs, k.to(q.dtype), v.to(q.dtype))
            out[start:end] = o.squeeze(0).transpose(0, 1)
            continue
        mask = _prefill_mask(num_new, context_len, sliding_window, q.device)
        # is_causal aligns the diagonal top-left, which is right only when nothing was cached.
        causal = mask is None and num_new == context_len and num_new > 1
        o = F.scaled_dot_product_attention(qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           is_causal=causal, enable_gqa=True)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


def mixed_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                    sliding_window: int | None, sinks: torch.Tensor | None,
                    decode: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor],
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`prefill_attention` of a step that is not decode-only, its one-token sequences
    (`meta.decode_part`) attended together by `decode(q rows, their metadata)`."""
    out = prefill_attention(q, kv_layer, meta, sliding_window, sinks, out)
    part = meta.decode_part
    if part is not None:
        out.index_copy_(0, part.rows, decode(q.index_select(0, part.rows), part.meta))
    return out


def _takes_sink_prefill(q: torch.Tensor, num_new: int, context_len: int) -> bool:
    """Whether `sink_prefill` serves a sequence: CUDA in half precision (CPU and float32 keep
    transformers' exact operations), a whole prompt (no cached prefix) of more than one
    token."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and num_new == context_len > 1)


def sink_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None,
                 sinks: torch.Tensor) -> torch.Tensor:
    """`sink_attention` of a whole prompt on itself (causal, within `sliding_window` if set)
    without its [heads, L, L] score matrix: q [1, heads, L, D], k, v [1, kv_heads, L, D].

    No window: flash attention, whose log-sum-exp gives the sink's share of the denominator,
    out * sum / (sum + exp(sink)) = out * sigmoid(lse - sink). A window W shorter than the
    prompt: queries in chunks of W, each over the 2W keys before its end, through
    `sink_attention` (scores [L / W, heads, W, 2W]).
    """
    length = q.shape[2]
    if sliding_window is None or sliding_window >= length:
        group = q.shape[1] // k.shape[1]
        k = k.to(q.dtype).repeat_interleave(group, dim=1)
        v = v.to(q.dtype).repeat_interleave(group, dim=1)
        out, lse = _flash_with_lse(q, k, v)
        share = torch.sigmoid(lse - sinks.float().reshape(1, -1, 1)).unsqueeze(-1)
        return (out.float() * share).to(q.dtype)
    window = sliding_window
    chunks = -(-length // window)
    pad = chunks * window - length
    # Chunk c's queries are positions [cW, (c+1)W); its keys [(c-1)W, (c+1)W).
    qc = F.pad(q, (0, 0, 0, pad)).view(*q.shape[:2], chunks, window, -1)[0].transpose(0, 1)
    kv_chunks = []
    for x in (k, v):
        padded = F.pad(x, (0, 0, window, pad))  # [1, kv_heads, (chunks + 1) W, D]
        kv_chunks.append(padded[0].unfold(1, 2 * window, window).permute(1, 0, 3, 2))
    i = torch.arange(window, device=q.device)[:, None]
    j = torch.arange(2 * window, device=q.device)[None, :]
    # Query i of chunk c is at position cW + i, key j at (c - 1)W + j: visible iff
    # i < j <= i + W (causal, within the window) and the key is not padding before the prompt
    # (j >= W in chunk 0).
    visible = ((j > i) & (j <= i + window))[None, None]
    first = torch.arange(chunks, device=q.device)[:, None, None, None] > 0
    visible = visible & (first | (j >= window))
    out = sink_attention(qc, kv_chunks[0], kv_chunks[1], visible, sinks)
    return out.transpose(0, 1).reshape(1, q.shape[1], chunks * window, -1)[:, :, :length]


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention [B, H, L, D] and its log-sum-exp [B, H, L] (float32, natural log of
    the softmax denominator), through torch's flash attention."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False)[:2]
    else:  # for checks on the CPU
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return out, lse


def _causal_on_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [1, heads, new, D] over k, v [1, kv_heads, context, D] whose last
    `new` positions are q's, through a fused kernel, K/V repeated to every query head (the
    fused kernels take no GQA).

    In half precision, torch's flash attention called directly: its causal mask is aligned
    lower right, which is what a chunk after a cached prefix needs, and the call skips SDPA's
    backend choice, which on an H100 (torch 2.11) picked cuDNN for whole prompts and built a
    cuDNN graph for every new prompt length: ~0.5 ms of host time per call, most of a mixed
    step's time at 512 tokens. Otherwise SDPA, with a lower-right causal bias for a chunk
    after a cached prefix rather than a [new, context] mask (which would leave only its
    unfused path)."""
    num_new, context_len = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    head_size = q.shape[-1]
    if q.dtype in (torch.bfloat16, torch.float16) and head_size % 8 == 0 and head_size <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    if num_new == context_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=num_new > 1)
    return F.scaled_dot_product_attention(q, k, v,
                                          attn_mask=causal_lower_right(num_new, context_len))


def _window_matters(context_len: int, sliding_window: int | None) -> bool:
    return sliding_window is not None and context_len > sliding_window


def _prefill_mask(num_new: int, context_len: int, sliding_window: int | None,
                  device: torch.device) -> torch.Tensor | None:
    """[num_new, context_len] bool (True = attend), or None where plain causal/full will do."""
    window_matters = _window_matters(context_len, sliding_window)
    if not window_matters and (num_new == context_len or num_new == 1):
        return None
    return _visible(num_new, context_len, sliding_window, device)


def _visible(num_new: int, context_len: int, sliding_window: int | None,
             device: torch.device) -> torch.Tensor:
    """[num_new, context_len] bool: which keys each of the last `num_new` positions sees."""
    first = context_len - num_new  # position of the first new token
    q_pos = torch.arange(first, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                     sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence, q [S, heads, head_size], in one batched SDPA.

    Keys are gathered for the full width of `meta.block_tables` (so the engine should pad it to
    the batch's longest table, not to the model length) and masked to `context_lens_t`. Query
    heads are folded into the query-length axis ([S, kv_heads, group, D]) so that GQA needs no
    repeat of K/V and no `enable_gqa`, which leaves every SDPA backend eligible on CUDA.
    With `sinks` [heads] the same masked attention runs through `sink_attention`.
    """
    num_seqs, num_heads, head_size = q.shape
    kv_heads = kv_layer.shape[3]
    block_tables = meta.block_tables
    max_len = block_tables.shape[1] * meta.block_size
    # [S, max_blocks, block_size, kv_heads, D] -> [S, kv_heads, max_len, D]
    k = kv_layer[0][block_tables].view(num_seqs, max_len, kv_heads, head_size).transpose(1, 2)
    v = kv_layer[1][block_tables].view(num_seqs, max_len, kv_heads, head_size).transpose(1, 2)
    k_pos = torch.arange(max_len, device=q.device)[None, :]
    context_lens = meta.context_lens_t[:, None]
    mask = k_pos < context_lens
    if sliding_window is not None:
        mask &= k_pos > context_lens - 1 - sliding_window
    if sinks is not None:
        o = sink_attention(q.unsqueeze(2), k, v, mask[:, None, None, :], sinks)
        return o.reshape(num_seqs, num_heads, head_size)
    qg = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_size)
    o = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype),
                                       attn_mask=mask[:, None, None, :])
    return o.reshape(num_seqs, num_heads, head_size)


class Attention(nn.Module):
    """One layer's attention: fused qkv projection, optional q/k RMSNorm (Qwen3), RoPE, paged
    attention (with gpt-oss's sinks where the spec has them), o_proj. `qkv_proj.weight` rows
    are [q | k | v] in HF's head order."""

    def __init__(self, spec: ModelSpec, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.q_size = spec.q_size
        self.kv_size = spec.kv_size
        self.sliding_window = sliding_window
        self.qkv_proj = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size,
                                  bias=spec.attention_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.attention_out_bias)
        self.q_norm = RMSNorm(spec.head_size, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_size, spec.rms_norm_eps) if spec.qk_norm else None
        self.sinks = (nn.Parameter(torch.empty(spec.num_heads)) if spec.attention_sinks
                      else None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_layer: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into kv_layer first."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_size)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_size)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(kv_layer, k, v, meta.slot_mapping)
        if meta.is_decode_only:
            o = self._decode(q, kv_layer, meta)
        else:
            o = mixed_attention(q, kv_layer, meta, self.sliding_window, self.sinks,
                                lambda rows, part: self._decode(rows, kv_layer, part))
        return self.o_proj(o.reshape(num_tokens, self.q_size))

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return decode_attention(q, kv_layer, meta, self.sliding_window, self.sinks)

    def forward_fused(self, x: torch.Tensor, rope_table: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, kv_layer: torch.Tensor) -> torch.Tensor:
        """`forward` through the Triton kernels (CUDA, half precision, no q/k norm:
        DecoderModel.fusable sends those to `forward`): RoPE and the cache write in one
        kernel, decode attention (with gpt-oss's sinks) read in place from the blocks."""
        num_tokens = x.shape[0]
        q = self.rotate_and_cache(x, rope_table, positions, kv_layer, meta.slot_mapping)
        o = self.attend_fused(q, kv_layer, meta)
        return kernels.linear(o.reshape(num_tokens, self.q_size), self.o_proj)

    def rotate_and_cache(self, x: torch.Tensor, rope_table: torch.Tensor,
                         positions: torch.Tensor, kv_layer: torch.Tensor,
                         slot_mapping: torch.Tensor, out: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """`forward_fused` up to the attention: the qkv projection, RoPE and the cache write;
        returns q [T, heads, head_size] (into `out` where given)."""
        return kernels.rope_and_cache(kernels.linear(x, self.qkv_proj), rope_table, positions,
                                      kv_layer, slot_mapping, self.num_heads,
                                      self.num_kv_heads, self.head_size, out)

    def attend_fused(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """`forward_fused`'s attention of q [T, heads, head_size] over the cache (K/V already
        written), into `out` where given (a step with prompt chunks; a decode-only step's
        kernel returns its own tensor)."""
        if meta.is_decode_only:
            o = self._decode_fused(q, kv_layer, meta)
            return o if out is None else out.copy_(o)
        return mixed_attention(q, kv_layer, meta, self.sliding_window, self.sinks,
                               lambda rows, part: self._decode_fused(rows, kv_layer, part), out)

    def _decode_fused(self, q: torch.Tensor, kv_layer: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        return kernels.paged_decode_attention(q, kv_layer, meta.block_tables,
                                              meta.context_lens_t, meta.block_size,
                                              self.sliding_window, sinks=self.sinks)
