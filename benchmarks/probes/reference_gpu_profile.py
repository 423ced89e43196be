"""Where a decode step of the 8B shape spends its time (a tool, not a test).

    PYTHONPATH=. python3 benchmarks/probes/reference_gpu_profile.py [--batch 64]
        [--context 128] [--quantization fp8] [--kv-cache-dtype fp8] [--eager]

`--batch` requests with prompts of `--context` tokens decode together; once every prompt is in
(decode steps only), torch.profiler records `--steps` steps. Prints the steps' wall time, the
device's busy time per step (the kernels' summed time: CUDA graph replays are traced kernel by
kernel; busy well under wall means the host bounds the step), and the kernel table by device
time. With `--out` the figures go to a JSON file as well.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile
import time

from torch.profiler import ProfilerActivity, profile

from benchmarks.reference_gpu import LLAMA_8B, SMALL, generate, prompts_of, sync, write_config
from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine

BLOCK = 32


async def run(args: argparse.Namespace, root: pathlib.Path) -> dict:
    shape = SMALL if args.small else LLAMA_8B
    model_dir = write_config(root / "model", shape)
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device="cpu" if args.small else "cuda",
        dtype="float32" if args.small else "bfloat16", load_format="dummy",
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        num_gpu_blocks=args.batch * (args.context + args.steps + 64) // BLOCK + 256,
        kv_block_size=BLOCK, max_batch_size=args.batch, max_num_tokens=8192,
        enable_prefix_caching=False, enforce_eager=args.eager))
    await engine.start()
    vocab = shape["vocab_size"]
    await generate(engine, prompts_of(args.batch, 16, vocab, 1), 8)  # warm-up, graph capture
    # Prefill every prompt (and a few decode steps), then profile decode steps only.
    streams = asyncio.ensure_future(generate(
        engine, prompts_of(args.batch, args.context, vocab, 2), 64 + 2 * args.steps))
    running = engine.scheduler.running
    while len(running) < args.batch or any(r.num_computed < r.num_prompt for r in running):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    sync()
    steps0, start = engine.num_steps, time.perf_counter()
    activity = ProfilerActivity.CPU if args.small else ProfilerActivity.CUDA
    with profile(activities=[activity]) as prof:
        while engine.num_steps - steps0 < args.steps and not streams.done():
            await asyncio.sleep(0.001)
        sync()
    wall = time.perf_counter() - start
    steps = engine.num_steps - steps0
    await streams
    await engine.close()
    def busy(e):  # type: ignore[no-untyped-def]  # a smoke run on the CPU times host ops
        return e.self_cpu_time_total if args.small else e.self_device_time_total

    events = [e for e in prof.key_averages() if busy(e) > 0]
    device_us = sum(busy(e) for e in events)
    kernels = sorted(({"name": e.key[:90], "calls": e.count, "us_per_step": busy(e) / steps}
                      for e in events), key=lambda k: -k["us_per_step"])
    return {"batch": args.batch, "context": args.context, "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype, "eager": args.eager, "steps": steps,
            "wall_ms_per_step": 1000 * wall / steps,
            "device_ms_per_step": device_us / 1000 / steps, "kernels": kernels[:30]}


def report(fig: dict) -> None:
    print(f"\n== batch {fig['batch']}, context {fig['context']}, weights {fig['quantization']}, "
          f"KV {fig['kv_cache_dtype']}, {'eager' if fig['eager'] else 'graphs'}: "
          f"{fig['steps']} steps, {fig['wall_ms_per_step']:.2f} ms/step wall, "
          f"device busy "
          f"{fig['device_ms_per_step']:.2f} ms/step")
    print("\n| kernel | calls | us per step |\n|---|---:|---:|")
    for k in fig["kernels"]:
        print(f"| {k['name']} | {k['calls']} | {k['us_per_step']:.1f} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--small", action="store_true", help="a CPU smoke run of the script")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fig = await run(args, pathlib.Path(tmp))
    report(fig)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(fig, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
