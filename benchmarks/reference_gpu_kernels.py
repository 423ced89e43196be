"""Per-kernel GPU times of a decode step's pieces for the 8B shape (a tool, not a test): each
piece captured 20 times in a CUDA graph and replayed, so launch gaps stay out.

    PYTHONPATH=. python3 benchmarks/reference_gpu_kernels.py [--gemv-sweep] [--attention]
"""
from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.engines.reference import kernels

DT = torch.bfloat16


def graph_us(fn: Callable[[], object], reps: int = 20, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / (reps * replays)


def _rotate(x: torch.Tensor, weights: list[torch.Tensor], turn: list[int]) -> None:
    F.linear(x, weights[turn[0] % len(weights)])
    turn[0] += 1


def _skinny_rotate(x: torch.Tensor, weights: list[torch.Tensor], turn: list[int]) -> None:
    kernels.skinny_gemm(x, weights[turn[0] % len(weights)])
    turn[0] += 1


def skinny_rows(batch: int) -> list[str]:
    rows = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=DT, device="cuda") for _ in range(2)]
        x = torch.randn(batch, k, dtype=DT, device="cuda")
        us = graph_us(functools.partial(_skinny_rotate, x, weights, [0]))
        rows.append(f"| skinny_gemm {name} [{n}x{k}], M={batch} | {us:.1f} us | "
                    f"{n * k * 2 / us / 1e6:.2f} TB/s |")
    return rows


def gemv_rows(batch: int) -> list[str]:
    rows = []
    for name, (n, k) in {"qkv": (6144, 4096), "o_proj": (4096, 4096),
                         "gate_up": (28672, 4096), "down": (4096, 14336)}.items():
        # Several weights in rotation, so that no run reads from L2.
        weights = [torch.randn(n, k, dtype=DT, device="cuda") for _ in range(4)]
        x = torch.randn(batch, k, dtype=DT, device="cuda")
        us = graph_us(functools.partial(_rotate, x, weights, [0]))
        rows.append(f"| F.linear {name} [{n}x{k}], M={batch} | {us:.1f} us | "
                    f"{n * k * 2 / us / 1e6:.2f} TB/s |")
    return rows


SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
CONFIGS = [(8, 512, 4), (16, 256, 4), (16, 512, 4), (16, 512, 8), (32, 256, 4), (32, 256, 8),
           (4, 1024, 4), (8, 1024, 8), (16, 1024, 8)]


def _gemv_rotate(x: torch.Tensor, weights: list[torch.Tensor], turn: list[int],
                 config: tuple[int, int, int]) -> None:
    kernels.gemv(x, weights[turn[0] % len(weights)], config)
    turn[0] += 1


def gemv_sweep() -> list[str]:
    """The Triton GEMV's tiles on each projection of the 8B shape, batch 1."""
    rows = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=DT, device="cuda") for _ in range(2 if n > 100000
                                                                              else 4)]
        x = torch.randn(1, k, dtype=DT, device="cuda")
        cublas = graph_us(functools.partial(_rotate, x, weights, [0]))
        best = min((graph_us(functools.partial(_gemv_rotate, x, weights, [0], c)), c)
                   for c in CONFIGS)
        rows.append(f"| {name} [{n}x{k}], M=1: cuBLAS {cublas:.1f} us, Triton best {best[0]:.1f}"
                    f" us {best[1]} | {n * k * 2 / best[0] / 1e6:.2f} TB/s |")
        for c in CONFIGS:
            us = graph_us(functools.partial(_gemv_rotate, x, weights, [0], c))
            rows.append(f"| {name} gemv {c} | {us:.1f} us | {n * k * 2 / us / 1e6:.2f} TB/s |")
    return rows


def attention_rows() -> list[str]:
    rows = []
    for batch, ctx in ((1, 160), (1, 1024), (64, 1024), (128, 1024)):
        block, kvh, heads = 32, 8, 32
        width = -(-ctx // block)
        cache = torch.randn(2, batch * width + 1, block, kvh, 128, dtype=DT, device="cuda")
        tables = torch.randperm(batch * width, device="cuda").view(batch, width)
        q = torch.randn(batch, heads, 128, dtype=DT, device="cuda")
        lens = torch.full((batch,), ctx, device="cuda")
        kv_bytes = batch * ctx * kvh * 128 * 2 * 2
        for split in (64, 128, 256, 512):
            us = graph_us(functools.partial(kernels.paged_decode_attention, q, cache, tables,
                                            lens, block, split_tokens=split))
            rows.append(f"| decode attention batch {batch}, ctx {ctx}, split {split} | "
                        f"{us:.1f} us | {kv_bytes / us / 1e6:.2f} TB/s |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="batch 1: cuBLAS vs the GEMV's tiles (the tiles GEMV_CONFIGS autotunes over)")
    parser.add_argument("--attention", action="store_true",
                        help="decode attention per context split size (SPLIT_TOKENS)")
    args = parser.parse_args()
    rows = [row for batch in (8, 64, 128) for row in gemv_rows(batch) + skinny_rows(batch)]
    if args.gemv_sweep:
        rows += gemv_sweep()
    if args.attention:
        rows += attention_rows()
    print("| piece | time | bytes/s |\n|---|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
