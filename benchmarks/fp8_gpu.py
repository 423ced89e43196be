"""FP8 weights on a GPU (a script, not a test): issue 42's FP8 rows for the Llama-3.1-8B shape.

1. kernels: each projection of the shape (qkv, o, gate_up, down) at 1 to 4,096 rows: bf16
   (the engine's gemv/skinny kernels, cuBLAS past 64 rows) against FP8: W8A16 for one row,
   W8A8 (Triton, row and 128x128 block scales; cuBLAS `torch._scaled_mm`, row scales),
   microseconds and the weights' read rate; each FP8 result's error against the dequantized
   product.
2. engines: dummy weights in bf16, FP8 rows (`--quantization fp8`), FP8 128x128 blocks (a
   fine-grained FP8 config) and FP8 rows with an FP8 KV cache (`--kv-cache-dtype fp8`):
   batch-1 decode ITL (CUDA graphs) and its floor (weight bytes over the measured copy
   bandwidth), and 1000/1000 output tokens/s with all requests at once at each concurrency.

    PYTHONPATH=. python3 benchmarks/fp8_gpu.py [--phases kernels bf16 fp8 fp8-block fp8-kv]
        [--concurrency 128 256] [--out fp8_gpu.json]

Each engine runs in its own process (the whole GPU free for it); the kernel sweep too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.reference_gpu import (
    LLAMA_8B,
    copy_bandwidth,
    generate,
    itl_ms,
    prompts_of,
    replay_ms,
    sync,
    write_config,
)
from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine

PHASES = ("kernels", "bf16", "fp8", "fp8-block", "fp8-kv")
BLOCK = 32
#: (name, N, K) of the 8B shape's projections.
PROJECTIONS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
               ("down", 4096, 14336))
ROWS = (1, 8, 64, 128, 256, 1024, 4096)


def kernel_rows() -> list[dict]:
    import triton.testing

    from tandem.engines.reference.quant.fp8 import Fp8Linear
    from tandem.engines.reference.quant.fp8_format import dequantize
    from tandem.model.quantize import quantize_tensor

    out = []
    for name, n, k in PROJECTIONS:
        weight = torch.randn(n, k, device="cuda") * 0.02
        dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        dense.weight.data.copy_(weight)
        layers = {}
        for label, block in (("rows", None), ("blocks", (128, 128))):
            q, scale = quantize_tensor(weight, "block" if block else "channel", block or (1, 1))
            layer = Fp8Linear(k, n, False, block, torch.bfloat16).cuda()
            layer.weight.data.copy_(q)
            layer.weight_scale.data.copy_(scale.reshape(layer.weight_scale.shape))
            layers[label] = layer
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = {label: torch.nn.functional.linear(
                x.float(), dequantize(layer.weight, layer.weight_scale, layer.block,
                                      torch.float32)) for label, layer in layers.items()}

            candidates = _candidates(x, dense, layers)
            for label, fn in candidates.items():
                got = fn()
                us = 1000 * triton.testing.do_bench(fn, warmup=10, rep=50)
                weight_bytes = n * k * (2 if label == "bf16" else 1)
                key = "blocks" if "blocks" in label else "rows"
                error = (float((got.float() - ref[key]).norm() / ref[key].norm())
                         if label != "bf16" else float("nan"))
                row = {"proj": name, "rows": rows, "kernel": label, "us": us,
                       "weight_GBps": weight_bytes / us / 1e3, "rel_error": error}
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def _candidates(x: torch.Tensor, dense: torch.nn.Linear, layers: dict) -> dict:
    """The kernels compared, as calls of x."""
    from tandem.engines.reference import kernels
    from tandem.engines.reference.quant import fp8_kernels
    rows, blocks = layers["rows"], layers["blocks"]

    def scaled_mm() -> torch.Tensor:
        xq, xs = fp8_kernels.quantize_tokens(x, None)
        return torch._scaled_mm(xq, rows.weight.t(), scale_a=xs,
                                scale_b=rows.weight_scale.reshape(1, -1),
                                out_dtype=torch.bfloat16)

    out = {"bf16": lambda: kernels.linear(x, dense)}
    if x.shape[0] == 1:
        out["fp8 W8A16 rows"] = lambda: fp8_kernels.gemv(x, rows.weight, rows.weight_scale, None)
        out["fp8 W8A16 blocks"] = lambda: fp8_kernels.gemv(x, blocks.weight, blocks.weight_scale,
                                                           (128, 128))
    out["fp8 W8A8 rows"] = lambda: fp8_kernels.gemm(x, rows.weight, rows.weight_scale, None)
    out["fp8 W8A8 blocks"] = lambda: fp8_kernels.gemm(x, blocks.weight, blocks.weight_scale,
                                                      (128, 128))
    out["fp8 W8A8 rows (cuBLAS)"] = scaled_mm
    return out


async def engine_figures(phase: str, root: pathlib.Path, concurrency: list[int]) -> dict:
    shape = dict(LLAMA_8B)
    if phase == "fp8-block":
        shape["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
    model_dir = write_config(root / phase, shape)
    isl = osl = 1000
    conc = max(concurrency)
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
        quantization="fp8" if phase in ("fp8", "fp8-kv") else "auto",
        kv_cache_dtype="fp8" if phase == "fp8-kv" else "auto",
        num_gpu_blocks=conc * (isl + osl) // BLOCK + 512, kv_block_size=BLOCK,
        max_batch_size=conc, max_num_tokens=8192, enable_prefix_caching=False))
    vocab = shape["vocab_size"]
    params = list(engine.model.parameters())
    figures: dict = {"phase": phase, "weights": sum(p.numel() * p.element_size() for p in params)}
    await engine.start()
    await generate(engine, prompts_of(1, 128, vocab), 8)
    (_, times), = await generate(engine, prompts_of(1, 128, vocab, 1), 96)
    figures["b1_itl_ms"] = itl_ms(times[2:])
    figures["b1_replay_ms"] = replay_ms(engine)
    print(json.dumps(figures), flush=True)
    for c in concurrency:
        await generate(engine, prompts_of(c, 16, vocab, 20), 4)
        sync()
        start = time.perf_counter()
        results = await generate(engine, prompts_of(c, isl, vocab, 21 + c), osl)
        tps = sum(len(t) for t, _ in results) / (time.perf_counter() - start)
        figures[f"tps_{c}"] = tps
        print(f"{phase}: {c} x 1000/1000: {tps:,.0f} output tokens/s", flush=True)
    await engine.close()
    figures["copy_Bps"] = copy_bandwidth()
    return figures


def run_phase(phase: str, concurrency: list[int]) -> dict:
    if phase == "kernels":
        return {"phase": phase, "rows": kernel_rows()}
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(engine_figures(phase, pathlib.Path(tmp), concurrency))


def report(results: dict[str, dict]) -> None:
    if "kernels" in results:
        print("\n| projection | rows | kernel | us | weight GB/s | rel. error |\n"
              "|---|---:|---|---:|---:|---:|")
        for r in results["kernels"]["rows"]:
            print(f"| {r['proj']} | {r['rows']} | {r['kernel']} | {r['us']:.1f} | "
                  f"{r['weight_GBps']:,.0f} | {r['rel_error']:.4f} |")
    engines = [results[p] for p in PHASES[1:] if p in results]
    if engines:
        concs = sorted({int(k[4:]) for e in engines for k in e if k.startswith("tps_")})
        print("\n| weights | GB | batch-1 ITL ms | graph replay ms | floor ms | ITL / floor | "
              + " | ".join(f"{c} x 1000/1000 tok/s" for c in concs) + " |\n|---|"
              + "---:|" * (5 + len(concs)))
        for e in engines:
            floor = 1000 * e["weights"] / e["copy_Bps"]
            print(f"| {e['phase']} | {e['weights'] / 1e9:.2f} | {e['b1_itl_ms']:.2f} | "
                  f"{e['b1_replay_ms']:.2f} | {floor:.2f} | {e['b1_itl_ms'] / floor:.2f}x | "
                  + " | ".join(f"{e.get(f'tps_{c}', float('nan')):,.0f}" for c in concs)
                  + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--out", default="fp8_gpu.json")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:  # one phase, in this process
        pathlib.Path(args.out).write_text(json.dumps(run_phase(args.phase, args.concurrency)))
        return
    results = {}
    for phase in args.phases:
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "phase.json"
            subprocess.run([sys.executable, __file__, "--phase", phase, "--out", str(out),
                            "--concurrency", *map(str, args.concurrency)], check=True)
            results[phase] = json.loads(out.read_text())
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{torch.cuda.get_device_name()}")
    report(results)


if __name__ == "__main__":
    main()
