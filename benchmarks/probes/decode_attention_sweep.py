"""Decode attention's tile against the KV cache's dtype (a tool, not a test).

    PYTHONPATH=. python3 benchmarks/probes/decode_attention_sweep.py [--batch 128 256]
        [--context 1500]

The Llama-3.1-8B shape's attention (32 heads over 8 KV heads of 128, 32-token blocks), one new
token per sequence over `--context` tokens each, bf16 and FP8 (e4m3) caches: microseconds per
layer inside a CUDA graph and the cache's read rate, for each tile (tokens per loop iteration,
warps, pipeline stages) of `kernels.paged_decode_attention`, and each tile's largest
difference from the default tile's output.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.reference_gpu_kernels import graph_us
from tandem.engines.reference import kernels

BLOCK, KV_HEADS, HEADS, HEAD = 32, 8, 32, 128


def sweep(batch: int, context: int, dtype: torch.dtype) -> list[dict]:
    width = -(-context // BLOCK)
    cache = torch.randn(2, batch * width + 1, BLOCK, KV_HEADS, HEAD, device="cuda").to(dtype)
    tables = torch.randperm(batch * width, device="cuda").view(batch, width)
    q = torch.randn(batch, HEADS, HEAD, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), context, device="cuda")
    kv_bytes = batch * context * KV_HEADS * HEAD * 2 * cache.element_size()
    call = functools.partial(kernels.paged_decode_attention, q, cache, tables, lens, BLOCK)
    base = call()
    rows = []
    for per_iter, warps, stages in itertools.product((32, 64, 128, 256), (4, 8), (2, 3)):
        tile = dict(tokens_per_iter=per_iter, num_warps=warps, num_stages=stages)
        try:
            diff = float((call(**tile).float() - base.float()).abs().max())
            us = graph_us(functools.partial(call, **tile))
        except Exception as exc:  # noqa: BLE001  # a tile that does not compile is a row too
            rows.append({**tile, "error": repr(exc)[:120]})
            continue
        rows.append({**tile, "us": us, "TBps": kv_bytes / us / 1e6, "max_diff": diff})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--context", type=int, default=1500)
    args = parser.parse_args()
    print("| batch | KV | tokens/iter | warps | stages | us | TB/s | max diff |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            for r in sweep(batch, args.context, dtype):
                head = (f"| {batch} | {name} | {r['tokens_per_iter']} | {r['num_warps']} | "
                        f"{r['num_stages']} |")
                if "error" in r:
                    print(f"{head} {r['error']} | | |", flush=True)
                else:
                    print(f"{head} {r['us']:.1f} | {r['TBps']:.2f} | {r['max_diff']:.3g} |",
                          flush=True)


if __name__ == "__main__":
    main()
