"""One-row FP8 (W8A16) kernels for the Llama-3.1-8B projections, side by side (a probe): the
engine's kernel at each of its tiles, a variant that reduces over K every iteration (fewer live
accumulators, more loads in flight), and a split-K variant (K cut over programs, float32 atomics
into a zeroed row, then scaled and cast), against the bf16 gemv. Microseconds from CUDA events
over replays of a CUDA graph of 50 launches, and the read rate of the FP8 weight bytes.

    PYTHONPATH=. python3 benchmarks/probes/fp8_gemv_probe.py      # on a CUDA machine
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engines.reference import kernels
from tandem.engines.reference.quant import fp8_kernels
from tandem.engines.reference.quant.fp8 import FP8

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


@triton.jit
def _reduce_each_kernel(x_ptr, w_ptr, s_ptr, out_ptr, n_rows, k_cols,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * k_cols + cols[None, :],
                    mask=row_mask[:, None], other=0.0)
        x = tl.load(x_ptr + cols).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    y = acc * tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, part_ptr, n_rows, k_cols, k_per,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    k_start = tl.program_id(1) * k_per
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_start, k_start + k_per, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * k_cols + cols[None, :],
                    mask=row_mask[:, None], other=0.0)
        x = tl.load(x_ptr + cols).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    tl.atomic_add(part_ptr + rows, tl.sum(acc, axis=1), mask=row_mask)


def timed_us(fn, launches: int = 50, replays: int = 10) -> float:
    """Microseconds per call inside a CUDA graph of `launches` calls (the launches' host cost
    out of the figure, as in the engine's decode graphs)."""
    for i in range(3):  # compile and autotune before capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (launches * replays)


def probe(name: str, n: int, k: int) -> None:
    dev = "cuda"
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    w16 = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
    scale = w16.abs().amax(1).float() / 448.0
    w8 = (w16.float() / scale[:, None]).to(FP8)
    # Copies enough to overflow the L2 cache (the engine reads each layer's weights once
    # per step): launch i reads copy i % len.
    copies = max(1, -(-256 * 2**20 // (n * k)))
    w8s = [w8] + [w8.clone() for _ in range(copies - 1)]
    w16s = [w16] + [w16.clone() for _ in range(copies - 1)]
    out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    ref = (x.float() @ (w8.float() * scale[:, None]).t())
    rows: list[tuple[str, float, float]] = []

    def add(label: str, fn, result=None) -> None:
        us = timed_us(fn)
        err = ((result() if result else fn(0)).float() - ref).abs().max().item()
        rows.append((label, us, err))

    add("bf16 gemv", lambda i: kernels.gemv(x, w16s[i % copies]))
    add("fp8 engine (autotuned)",
        lambda i: fp8_kernels.gemv(x, w8s[i % copies], scale.reshape(-1, 1), None))
    for bn, bk, warps, reduce_each in fp8_kernels.GEMV_CONFIGS:
        add(f"fp8 engine {bn}x{bk} w{warps}{' r' if reduce_each else ''}", lambda i, bn=bn, bk=bk, warps=warps, reduce_each=reduce_each:
            fp8_kernels._fp8_gemv_kernel[(triton.cdiv(n, bn),)](
                x, w8s[i % copies], scale, scale, out, n, k, 0, BLOCK_N=bn, BLOCK_K=bk, SBN=0, SBK=1,
                SWIGLU=False, HAS_BIAS=False, REDUCE_EACH=reduce_each, num_warps=warps), lambda: out)
    for bn, bk, warps in ((8, 512, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4),
                          (4, 1024, 4), (8, 1024, 8), (64, 128, 4), (32, 512, 8)):
        add(f"reduce-each {bn}x{bk} w{warps}", lambda i, bn=bn, bk=bk, warps=warps:
            _reduce_each_kernel[(triton.cdiv(n, bn),)](
                x, w8s[i % copies], scale, out, n, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps),
            lambda: out)
    part = torch.zeros(n, dtype=torch.float32, device=dev)
    for splits in (2, 4, 8):
        for bn, bk, warps in ((16, 512, 4), (16, 1024, 8), (8, 1024, 4)):
            k_per = k // splits
            if k_per % bk:
                continue

            def split(i: int, bn=bn, bk=bk, warps=warps, splits=splits,
                      k_per=k_per) -> None:
                part.zero_()
                _split_k_kernel[(triton.cdiv(n, bn), splits)](
                    x, w8s[i % copies], part, n, k, k_per, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
                torch.mul(part, scale, out=part)

            add(f"split-k {splits} {bn}x{bk} w{warps} (+2 ops)", split,
                lambda: part.reshape(1, -1))
    best = min(rows[1:], key=lambda r: r[1])
    for label, us, err in rows:
        mark = " <" if (label, us, err) == best else ""
        print(f"{name:9s} {label:32s} {us:6.1f}  {n * k / us / 1e6:5.2f}  "
              f"err {err:.1e}{mark}")


def main() -> None:
    torch.manual_seed(0)
    print("proj      variant                         us    TB/s (fp8 bytes)")
    for name, (n, k) in SHAPES.items():
        probe(name, n, k)


if __name__ == "__main__":
    main()
