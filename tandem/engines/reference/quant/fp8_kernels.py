"""Triton kernels for FP8 weights on GPUs with FP8 (compute capability 8.9+).

- `_fp8_gemv_kernel` (one row, a batch-1 decode step): W8A16. Each weight is read once as FP8
  and multiplied in float32 by the bf16 activation; the scale is applied in float32 (a row's
  after its sum; a block's to the activations of its columns, which one program's rows share:
  BLOCK_N divides the scale block's height). Like the engine's bf16 gemv it reads long rows
  (BLOCK_K up to 4,096), so few programs still keep enough bytes in flight.
- `_quantize_tokens_kernel` (2+ rows): the activations scaled to FP8 per token (per
  128-column group under block scales, as DeepSeek's recipe does) in one pass, then W8A8 on
  the FP8 tensor cores: cuBLAS' `torch._scaled_mm` under row scales (measured faster than bf16
  from 8 rows up on the 8B shape's MLP, benchmarks/fp8_gpu.py), `_fp8_gemm_kernel` under
  block scales, which cuBLAS' row-scaled GEMM cannot take (slower than bf16 past ~64 rows:
  RESULTS.md).
"""
from __future__ import annotations

import torch

from tandem.engines.reference.quant.fp8_format import FP8, dequantize
from tandem.engines.reference.quant.scheme import FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None

#: (BLOCK_N, BLOCK_K, warps, reduce each iteration) of the one-row kernel: the bf16 gemv's
#: shapes with twice the columns, for the same bytes per load; and shorter tiles summed over K
#: every iteration (one float32 per row live, not BLOCK_K), which read the wide gate/up
#: projection of the 8B shape at 4.0 TB/s where the others reach 3.3 (in CUDA graphs, on the
#: H200: benchmarks/probes/fp8_gemv_probe.py).
GEMV_CONFIGS = ((16, 2048, 8, False), (8, 2048, 8, False), (8, 2048, 4, False),
                (4, 2048, 4, False), (2, 2048, 4, False), (4, 4096, 8, False),
                (16, 1024, 8, False), (8, 1024, 4, False), (32, 1024, 8, False),
                (32, 256, 4, True), (16, 512, 4, True), (4, 1024, 4, True), (8, 1024, 8, True))
#: (BLOCK_N, warps, stages) of the W8A8 kernel; BLOCK_K is 128 (one scale block) and BLOCK_M
#: follows the row count.
GEMM_CONFIGS = ((64, 4, 4), (128, 4, 4), (128, 8, 3), (256, 8, 3), (64, 4, 6), (32, 4, 4))
GEMM_BLOCK_K = 128

if triton is not None:
    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, n_rows, k_cols, s_cols,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SBN: tl.constexpr,
                         SBK: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                         REDUCE_EACH: tl.constexpr = False):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        total = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, k_cols, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < k_cols
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * k_cols + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
            if SWIGLU:  # x is [gate | up], as the bf16 gemv reads it
                up = tl.load(x_ptr + k_cols + cols, mask=col_mask, other=0.0)
                gate = x.to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
                x = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
            xf = x.to(tl.float32)
            if SBN > 0:  # this program's rows share one block row: scale per column
                block_row = tl.program_id(0) * BLOCK_N // SBN
                xf = xf * tl.load(s_ptr + block_row * s_cols + cols // SBK, mask=col_mask,
                                  other=0.0)
            if REDUCE_EACH:
                total += tl.sum(w.to(tl.float32) * xf[None, :], axis=1)
            else:
                acc += w.to(tl.float32) * xf[None, :]
        if REDUCE_EACH:
            y = total
        else:
            y = tl.sum(acc, axis=1)
        if SBN == 0:
            y = y * tl.load(s_ptr + rows, mask=row_mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, k_cols, s_cols, GROUP: tl.constexpr,
                                BLOCK: tl.constexpr):
        """Row `program_id(0)`, group `program_id(1)` of GROUP columns (GROUP = BLOCK: the
        whole row when GROUP is the row's padded width): q = x / s, s = amax / FP8_MAX."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
        mask = cols < k_cols
        x = tl.load(x_ptr + row * k_cols + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x)), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * k_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * s_cols + tl.program_id(1), scale)

    @triton.jit(do_not_specialize=["m_rows"])
    def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, m_rows, n_rows, k_cols,
                         xs_cols, s_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SBN: tl.constexpr, HAS_BIAS: tl.constexpr):
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        m_mask = m < m_rows
        n_mask = cols < n_rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_cols, BLOCK_K):
            k = k0 + kk
            k_mask = k < k_cols
            x = tl.load(x_ptr + m.to(tl.int64)[:, None] * k_cols + k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * k_cols + k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            part = tl.dot(x, tl.trans(w))
            if SBN > 0:  # per-group activation scales and per-block weight scales
                xs = tl.load(xs_ptr + m * xs_cols + k0 // BLOCK_K, mask=m_mask, other=0.0)
                ws = tl.load(s_ptr + (cols // SBN) * s_cols + k0 // BLOCK_K, mask=n_mask,
                             other=0.0)
                acc += part * xs[:, None] * ws[None, :]
            else:
                acc += part
        if SBN == 0:
            xs = tl.load(xs_ptr + m * xs_cols, mask=m_mask, other=0.0)
            acc = acc * xs[:, None] * tl.load(s_ptr + cols, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m.to(tl.int64)[:, None] * n_rows + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    _gemv = triton.autotune(configs=[
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "REDUCE_EACH": r}, num_warps=w)
        for n, k, w, r in GEMV_CONFIGS],
        key=["n_rows", "k_cols", "SWIGLU", "HAS_BIAS", "SBN", "SBK"])(_fp8_gemv_kernel)
    _gemm = triton.autotune(configs=[
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in GEMM_CONFIGS],
        key=["n_rows", "k_cols", "BLOCK_M", "SBN"])(_fp8_gemm_kernel)


def serves_block(block: tuple[int, int] | None) -> bool:
    """Whether the kernels take scales of this block shape (None: row scales): blocks as the
    FP8 checkpoints ship them, 128 columns wide and a multiple of 32 rows high (the one-row
    kernel's programs must not straddle two block rows)."""
    return block is None or (block[1] == GEMM_BLOCK_K and block[0] % 32 == 0)


def quantize_tokens(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations [M, K] and float32 scales, one per row ([M, 1]) or per `group` columns
    of each row ([M, K / group]), in one pass."""
    m_rows, k_cols = x.shape
    q = torch.empty(m_rows, k_cols, dtype=FP8, device=x.device)
    width = group or k_cols
    groups = -(-k_cols // width)
    scales = torch.empty(m_rows, groups, dtype=torch.float32, device=x.device)
    _quantize_tokens_kernel[(m_rows, groups)](x, q, scales, k_cols, groups, GROUP=width,
                                              BLOCK=triton.next_power_of_2(width))
    return q, scales


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
         block: tuple[int, int] | None, bias: torch.Tensor | None = None,
         swiglu: bool = False) -> torch.Tensor:
    """One row: x [1, K] (bf16/fp16; [1, 2K] = [gate | up] with `swiglu`) @ (FP8 weight [N, K]
    x scales).T (+ bias) -> [1, N] in x's dtype (W8A16)."""
    n_rows, k_cols = weight.shape
    out = torch.empty(1, n_rows, dtype=x.dtype, device=x.device)
    sbn, sbk = block if block is not None else (0, 1)
    _gemv[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_N"]),)](
        x, weight, scale, bias if bias is not None else scale, out, n_rows, k_cols,
        scale.shape[1] if block is not None else 0, SBN=sbn, SBK=sbk, SWIGLU=swiglu,
        HAS_BIAS=bias is not None)
    return out


def gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
         block: tuple[int, int] | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, contiguous) @ (FP8 weight [N, K] x scales).T (+ bias) -> [M, N]
    in x's dtype, W8A8 on the FP8 tensor cores."""
    m_rows, k_cols = x.shape
    n_rows = weight.shape[0]
    xq, xs = quantize_tokens(x, GEMM_BLOCK_K if block is not None else None)
    out = torch.empty(m_rows, n_rows, dtype=x.dtype, device=x.device)
    block_m = min(128, max(16, triton.next_power_of_2(m_rows)))
    _gemm[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_N"]), triton.cdiv(m_rows, block_m))](
        xq, xs, weight, scale, bias if bias is not None else scale, out, m_rows, n_rows,
        k_cols, xs.shape[1], scale.shape[1] if block is not None else 0, BLOCK_M=block_m,
        BLOCK_K=GEMM_BLOCK_K, SBN=block[0] if block is not None else 0,
        HAS_BIAS=bias is not None)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           block: tuple[int, int] | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 product for any row count: the one-row kernel, W8A8 for more rows; block
    shapes the kernels do not take are dequantized and multiplied by cuBLAS."""
    if not serves_block(block):
        return torch.nn.functional.linear(x, dequantize(weight, scale, block, x.dtype), bias)
    if x.shape[0] == 1:
        return gemv(x, weight, scale, block, bias)
    if block is not None:
        return gemm(x, weight, scale, block, bias)
    xq, xs = quantize_tokens(x, None)
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.reshape(1, -1),
                           out_dtype=x.dtype)
    return out if bias is None else out + bias


assert FP8_MAX == 448.0  # the kernels' literal
