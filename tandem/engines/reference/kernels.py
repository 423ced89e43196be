"""Triton kernels of the reference engine's CUDA path (bf16/fp16 models; fp32 and the CPU keep
the PyTorch path in attention.py and layers.py, unchanged).

A decode step at batch 1 reads 16 GB of weights in ~5 ms on an H100; the PyTorch path added
~45 small kernels per layer around the matmuls (RMSNorm, RoPE, the paged K/V gather, a masked
SDPA), each a few microseconds even inside a CUDA graph. These four kernels replace them:

* `add_rms_norm`: residual add and RMSNorm in one pass (one kernel instead of ~9).
* `rope_and_cache`: RoPE on q and k straight from the fused qkv output, and k/v written into
  the paged cache at their slots (one kernel instead of ~20).
* `paged_decode_attention`: one new token per sequence attending over its blocks, read in
  place through the block table (no gathered copy), split over the context in pieces of at
  most SPLIT_TOKENS (flash-decoding; more, shorter pieces for small batches), then one small
  reduction across the pieces; sliding windows and gpt-oss's attention sinks.
* `silu_and_mul`: SwiGLU's activation on the fused gate/up output.
* `gemv` and `skinny_gemm`: a decode step's projections (one row, or a batch of up to 64
  rows, times a weight matrix), where cuBLAS' kernels stay well under the copy bandwidth.

Rounding follows transformers op by op, so that bf16 outputs match its eager model: sums and
products of two half-precision tensors are rounded to that precision after each operation (as
PyTorch does for half tensors), RMSNorm normalises in float32 and rounds before the weight
multiply, RoPE rounds cos/sin to the model dtype first. Softmax and the attention accumulators
are float32, as in flash attention.
"""
from __future__ import annotations

import math

import torch

from tandem.engines.reference.quant import fp8_kernels
from tandem.engines.reference.quant.fp8 import Fp8Linear, fp8_gemm_supported

try:  # Triton ships with CUDA builds of PyTorch; CPU builds (and CI) have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve tensors like `x` (CUDA, half precision, Triton here)."""
    return serves(x.device, x.dtype)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """`available` for tensors of this device and dtype."""
    return (triton is not None and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                             PARTS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * PARTS * n_cols + cols, mask=mask, other=0.0)
        if PARTS > 1:  # x is PARTS rows to sum first (float32, rounded once: torch's sum)
            xs = x.to(tl.float32)
            for part in tl.static_range(1, PARTS):
                xs += tl.load(x_ptr + (row * PARTS + part) * n_cols + cols, mask=mask,
                              other=0.0).to(tl.float32)
            x = xs.to(x.dtype)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        if HAS_RESIDUAL or PARTS > 1:
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)

    @triton.jit
    def _rope_and_cache_kernel(qkv_ptr, cos_sin_ptr, pos_ptr, slot_ptr, q_out_ptr, kv_ptr,
                               v_plane, qkv_stride,
                               H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half: tl.constexpr = D // 2
        d = tl.arange(0, half)
        pos = tl.load(pos_ptr + t)
        dtype = q_out_ptr.dtype.element_ty
        cos = tl.load(cos_sin_ptr + pos * D + d).to(dtype).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * D + half + d).to(dtype).to(tl.float32)
        row = qkv_ptr + t * qkv_stride
        src = row + head * D  # q heads, then k heads: [q | k | v] rows of the fused projection
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + half + d).to(tl.float32)
        a = (x1 * cos).to(dtype).to(tl.float32)
        b = (x2 * sin).to(dtype).to(tl.float32)
        c = (x2 * cos).to(dtype).to(tl.float32)
        e = (x1 * sin).to(dtype).to(tl.float32)
        out1 = (a - b).to(dtype)
        out2 = (c + e).to(dtype)
        if head < H:
            dst = q_out_ptr + (t * H + head) * D
            tl.store(dst + d, out1)
            tl.store(dst + half + d, out2)
        else:
            kvh = head - H
            slot = tl.load(slot_ptr + t)
            kdst = kv_ptr + (slot * KVH + kvh) * D
            tl.store(kdst + d, out1.to(kv_ptr.dtype.element_ty))
            tl.store(kdst + half + d, out2.to(kv_ptr.dtype.element_ty))
            vsrc = row + (H + KVH + kvh) * D
            v1 = tl.load(vsrc + d)
            v2 = tl.load(vsrc + half + d)
            tl.store(kdst + v_plane + d, v1.to(kv_ptr.dtype.element_ty))
            tl.store(kdst + v_plane + half + d, v2.to(kv_ptr.dtype.element_ty))

    # The table's row stride is the graphs' static buffer width when captured, the step's
    # padded width in a mixed step: unspecialized, both take the variant the start-up captures
    # compiled (a mixed step's own, compiled on its first use, cost a burst 300-450 ms on an
    # H200 whose Triton cache lacked it).
    @triton.jit(do_not_specialize=["table_stride"])
    def _paged_decode_kernel(q_ptr, kv_ptr, table_ptr, ctx_ptr, sinks_ptr, out_ptr,
                             part_acc_ptr, part_ml_ptr, scale, window, v_plane, table_stride,
                             max_blocks_per_split, min_splits,
                             H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                             D: tl.constexpr, BS: tl.constexpr, BLOCK_G: tl.constexpr,
                             SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                             HAS_SINKS: tl.constexpr, NB: tl.constexpr,
                             FP16_DOT: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + s)
        num_blocks = tl.cdiv(ctx, BS)
        per_split = _blocks_per_split(num_blocks, max_blocks_per_split, min_splits)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, num_blocks)
        if HAS_WINDOW:
            lo = tl.maximum(lo, tl.maximum(ctx - window, 0) // BS)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        n = tl.arange(0, NB * BS)  # NB blocks per iteration: more bytes in flight per program
        heads = kvh * G + g
        g_mask = g < G
        q = tl.load(q_ptr + (s * H + heads)[:, None] * D + d[None, :], mask=g_mask[:, None],
                    other=0.0)
        if FP16_DOT:  # an FP8 cache: e4m3 widens to float16 in one instruction, not to bf16
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        if HAS_SINKS:
            # The sink is one more logit in the softmax's denominator (with no value): the
            # running max and sum start from it, in the first piece only.
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=float("-inf")).to(tl.float32)
            sink = tl.where(split == 0, sink, float("-inf"))
            m_i = sink
            l_i = tl.where(sink > float("-inf"), 1.0, 0.0)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for it in range(0, tl.cdiv(hi - lo, NB)):
            b = lo + it * NB
            index = b + n // BS
            inside = index < hi
            block = tl.load(table_ptr + s * table_stride + index, mask=inside,
                            other=0).to(tl.int64)
            offs = ((block * BS + n % BS) * KVH + kvh) * D
            # FP8 caches (--kv-cache-dtype fp8) are read back in float16, others in q's dtype.
            k = tl.load(kv_ptr + offs[:, None] + d[None, :], mask=inside[:, None],
                        other=0.0).to(q.dtype)
            v = tl.load(kv_ptr + v_plane + offs[:, None] + d[None, :], mask=inside[:, None],
                        other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k)) * scale
            pos = b * BS + n
            valid = (pos < ctx) & inside
            if HAS_WINDOW:
                valid = valid & (pos > ctx - 1 - window)
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS == 1:
            o = acc / l_i[:, None]
            tl.store(out_ptr + (s * H + heads)[:, None] * D + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            part = (s * H + heads) * SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)

    @triton.jit
    def _blocks_per_split(num_blocks, max_blocks_per_split, min_splits):
        """A sequence's piece of context per program: `min_splits` pieces, none longer than
        `max_blocks_per_split` blocks. Depends on the sequence's own context alone (never on
        the table width or batch a CUDA graph pads to), so graphs and eager agree."""
        return tl.minimum(max_blocks_per_split, tl.maximum(tl.cdiv(num_blocks, min_splits), 1))

    @triton.jit
    def _reduce_splits_kernel(part_acc_ptr, part_ml_ptr, ctx_ptr, out_ptr,
                              max_blocks_per_split, min_splits, H: tl.constexpr,
                              D: tl.constexpr, BS: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # s * H + head
        ctx = tl.load(ctx_ptr + row // H)
        num_blocks = tl.cdiv(ctx, BS)
        pieces = tl.cdiv(num_blocks, _blocks_per_split(num_blocks, max_blocks_per_split,
                                                         min_splits))
        d = tl.arange(0, D)
        one = tl.arange(0, 1)
        m_run = tl.full([1], float("-inf"), tl.float32)
        l_run = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        # The sequence's own pieces, in order (padding pieces past them are empty): the sum's
        # order does not depend on how many programs the grid had.
        for i in range(0, pieces):
            part = row * SPLITS + i
            m = tl.load(part_ml_ptr + part * 2 + one)
            lsum = tl.load(part_ml_ptr + part * 2 + 1 + one)
            m_new = tl.maximum(m_run, m)
            keep = tl.where(m_run > float("-inf"), tl.exp(m_run - m_new), 0.0)
            take = tl.where(m > float("-inf"), tl.exp(m - m_new), 0.0)
            acc = acc * keep + tl.load(part_acc_ptr + part * D + d) * take
            l_run = l_run * keep + lsum * take
            m_run = m_new
        tl.store(out_ptr + row * D + d, (acc / l_run).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, n_rows, k_cols, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, k_cols, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < k_cols
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * k_cols + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
            if SWIGLU:  # x is [gate | up]: silu(gate) * up, rounded as silu_and_mul rounds
                up = tl.load(x_ptr + k_cols + cols, mask=col_mask, other=0.0)
                gate = x.to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
                x = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:  # added before the one rounding, as cuBLAS' bias epilogue does
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.autotune(configs=[
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
        for n, k, w, st in ((32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3),
                            (64, 64, 4, 5), (16, 256, 4, 4), (64, 128, 8, 3))],
        key=["n_rows", "k_cols", "BLOCK_M"])
    # m_rows unspecialized: Triton compiles a variant per divisibility of an int argument,
    # and an eager step's row count (17-31 sampled rows, say) would otherwise compile one on a
    # request's step (~110-240 ms on an H100, benchmarks/probes/prefill_gpu.py --burst) that the
    # graphs' bucket sizes never did. It only masks rows.
    @triton.jit(do_not_specialize=["m_rows"])
    def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, m_rows, n_rows, k_cols,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        m_mask = m < m_rows
        n_mask = cols < n_rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_cols, BLOCK_K):
            k = k0 + kk
            k_mask = k < k_cols
            x = tl.load(x_ptr + m[:, None] * k_cols + k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * k_cols + k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * n_rows + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        tl.store(out_ptr + row * n_cols + cols,
                 (act.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [T, N]; without `residual`,
    (RMSNorm(x) * weight, x). x may also be [T, P, N], whose P rows are summed first (an MoE
    layer's per-slot outputs: x.sum(1) + residual, with x.sum(1) rounded once)."""
    parts = x.shape[1] if x.dim() == 3 else 1
    num_rows, n_cols = x.shape[0], x.shape[-1]
    x = x.contiguous()
    out = torch.empty(num_rows, n_cols, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None or parts > 1 else x
    block = triton.next_power_of_2(n_cols)
    _add_rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, summed, n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, PARTS=parts,
        num_warps=min(max(block // 256, 1), 16))
    return out, summed


def rope_and_cache(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                   kv_layer: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_size: int, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """q [T, heads, head_size] rotated (into `out`, contiguous, where given); k rotated and v
    written to `kv_layer` at their slots. `qkv` [T, (heads + 2 kv_heads) * head_size] is the
    fused projection's output (row stride may exceed the width); `cos_sin` the
    RotaryEmbedding table [max_positions, head_size]."""
    num_tokens = qkv.shape[0]
    q = (torch.empty(num_tokens, num_heads, head_size, dtype=qkv.dtype, device=qkv.device)
         if out is None else out)
    v_plane = kv_layer[1].data_ptr() - kv_layer[0].data_ptr()
    _rope_and_cache_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos_sin, positions, slot_mapping, q, kv_layer, v_plane // kv_layer.element_size(),
        qkv.stride(0), H=num_heads, KVH=num_kv_heads, D=head_size, num_warps=1)
    return q


#: Most context tokens one decode attention program covers (flash-decoding's split). Fixed, not
#: sized to the batch's table: a sequence's result then depends only on its own context, never
#: on the batch or table width it was padded to (CUDA graphs pad both), so graphs and eager
#: agree.
SPLIT_TOKENS = 512
#: Batches of at most this many sequences split each context into at least SMALL_BATCH_SPLITS
#: pieces: with few sequences, one program per 512 tokens leaves most of the GPU idle and the
#: step waits on a program's serial walk over its blocks. A power of two, so that every CUDA
#: graph batch bucket lies on one side of it as the batch it pads does.
SMALL_BATCH = 8
SMALL_BATCH_SPLITS = 8
#: Tokens of context a decode attention program reads per loop iteration (whole blocks, a
#: power of two of them), by the cache's bytes per element; its warps and pipeline stages.
#: An FP8 cache's program is bound by its instructions, not by the bytes it reads, unless
#: each iteration covers more tokens (benchmarks/probes/decode_attention_sweep.py on the H200:
#: history/engine.md, "FP8 KV cache, round 2").
DECODE_TOKENS_PER_ITER = {1: 128, 2: 32, 4: 32}
DECODE_WARPS = 4
DECODE_STAGES = 2


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int,
                           sliding_window: int | None = None,
                           split_tokens: int = SPLIT_TOKENS,
                           sinks: torch.Tensor | None = None,
                           tokens_per_iter: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence, q [S, heads, head_size], over the first
    `context_lens[s]` positions of its blocks `block_tables[s]` in `kv_layer`
    [2, num_blocks, block_size, kv_heads, head_size], or over the last `sliding_window` of them.
    `sinks` [heads]: gpt-oss's attention sinks (attention.sink_attention), or None.
    `tokens_per_iter`, `num_warps`, `num_stages`: the program's tile (DECODE_* by default).
    Returns [S, heads, head_size]."""
    num_seqs, num_heads, head_size = q.shape
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    max_per_split = max(split_tokens // block_size, 1)
    min_splits = SMALL_BATCH_SPLITS if num_seqs <= SMALL_BATCH else 1
    splits = min(max(min_splits, math.ceil(width / max_per_split)), width)
    if sliding_window is not None and sliding_window <= split_tokens:
        # A window this short is one piece wherever it lies (the loop starts at the window).
        splits = 1
    if splits == 1:  # one program covers the whole context: no pieces to reduce
        max_per_split, min_splits = width, 1
    out = torch.empty_like(q)
    part_acc = part_ml = out  # unused with one split
    if splits > 1:
        part_acc = torch.empty(num_seqs * num_heads * splits, head_size, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_seqs * num_heads * splits, 2, dtype=torch.float32,
                              device=q.device)
    v_plane = (kv_layer[1].data_ptr() - kv_layer[0].data_ptr()) // kv_layer.element_size()
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, kv_layer, block_tables, context_lens, sinks if sinks is not None else q, out,
        part_acc, part_ml, 1.0 / math.sqrt(head_size), sliding_window or 0, v_plane,
        block_tables.stride(0), max_per_split, min_splits, H=num_heads, KVH=num_kv_heads,
        G=group, D=head_size, BS=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
        SPLITS=splits, HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        NB=triton.next_power_of_2(max((tokens_per_iter or DECODE_TOKENS_PER_ITER.get(
            kv_layer.element_size(), 32)) // block_size, 1)),
        FP16_DOT=kv_layer.element_size() == 1,
        num_warps=num_warps or DECODE_WARPS, num_stages=num_stages or DECODE_STAGES)
    if splits > 1:
        _reduce_splits_kernel[(num_seqs * num_heads,)](
            part_acc, part_ml, context_lens, out, max_per_split, min_splits, H=num_heads,
            D=head_size, BS=block_size, SPLITS=splits, num_warps=1)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 I] ([gate | up] halves): [T, I]."""
    num_rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty(num_rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](gate_up, out, n_cols,
                                                                   BLOCK=block, num_warps=4)
    return out


#: GEMV tiles (rows, columns per iteration, warps), tried per weight shape on first use (before
#: CUDA-graph capture, in the graphs' warm-up): (16, 1024, 8) served the 8B shape's projections
#: best (benchmarks/reference_gpu_kernels.py --gemv-sweep); gpt-oss-20b's 2880-wide ones, its
#: router and LM head took 2 rows per program on the H100 (benchmarks/moe_gpu.py).
GEMV_CONFIGS = ((16, 1024, 8), (8, 1024, 8), (8, 1024, 4), (4, 1024, 4), (2, 1024, 4),
                (1, 1024, 4), (2, 2048, 8), (16, 512, 4), (32, 512, 8))

if triton is not None:
    _gemv_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                 for n, k, w in GEMV_CONFIGS],
        key=["n_rows", "k_cols", "SWIGLU", "HAS_BIAS"])(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor,
         config: tuple[int, int, int] | None = None, swiglu: bool = False,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias [N]) -> [1, N], float32 accumulation: a batch-1
    decode step's projections read their weights at closer to the copy bandwidth than cuBLAS'
    kernels. With `swiglu`, x is [1, 2K] ([gate | up]) and the product is
    silu_and_mul(x) @ weight.T. `config`: one tile of GEMV_CONFIGS' form instead of the
    fastest of them."""
    n_rows, k_cols = weight.shape
    out = torch.empty(1, n_rows, dtype=x.dtype, device=x.device)
    args = (x, weight, bias if bias is not None else weight, out, n_rows, k_cols)
    flags = {"SWIGLU": swiglu, "HAS_BIAS": bias is not None}
    if config is None:
        _gemv_tuned[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_N"]),)](*args, **flags)
    else:
        block_n, block_k, warps = config
        _gemv_kernel[(triton.cdiv(n_rows, block_n),)](*args, BLOCK_N=block_n, BLOCK_K=block_k,
                                                      num_warps=warps, **flags)
    return out


#: Most rows `skinny_gemm` serves (a decode batch); more go to cuBLAS, which is faster there
#: (benchmarks/reference_gpu_kernels.py: at 128 rows its tiles fall behind, at 8-64 they match or
#: beat it).
SKINNY_MAX_ROWS = 64


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] for 2 <= M <= SKINNY_MAX_ROWS: every
    weight tile is read once for all M rows (a decode step is bound by reading the weights);
    tiles autotuned per shape on first use (before CUDA-graph capture, in the graphs'
    warm-up)."""
    m_rows, k_cols = x.shape
    n_rows = weight.shape[0]
    out = torch.empty(m_rows, n_rows, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m_rows))
    _skinny_gemm_kernel[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out, m_rows, n_rows, k_cols,
        BLOCK_M=block_m, HAS_BIAS=bias is not None)
    return out


def linear(x: torch.Tensor, layer: torch.nn.Linear | Fp8Linear) -> torch.Tensor:
    """`layer(x)`; a decode batch goes through `gemv` (one row) or `skinny_gemm` (up to
    SKINNY_MAX_ROWS). FP8 layers pick their own kernels."""
    if isinstance(layer, Fp8Linear):
        return layer(x)
    rows = x.shape[0]
    if x.is_contiguous() and rows <= SKINNY_MAX_ROWS:
        if rows == 1:
            return gemv(x, layer.weight, bias=layer.bias)
        return skinny_gemm(x, layer.weight, layer.bias)
    return layer(x)


def swiglu_linear(gate_up: torch.Tensor, layer: torch.nn.Linear | Fp8Linear) -> torch.Tensor:
    """`layer(silu_and_mul(gate_up))`, in one kernel for one row."""
    one_row = gate_up.shape[0] == 1 and gate_up.is_contiguous()
    if isinstance(layer, Fp8Linear):
        if one_row and fp8_gemm_supported(gate_up.device) and fp8_kernels.serves_block(
                layer.block):
            return fp8_kernels.gemv(gate_up, layer.weight, layer.weight_scale, layer.block,
                                    layer.bias, swiglu=True)
        return layer(silu_and_mul(gate_up))
    if one_row:
        return gemv(gate_up, layer.weight, swiglu=True, bias=layer.bias)
    return linear(silu_and_mul(gate_up), layer)
