"""Where a decode step of the 8B shape spends its time (a tool, not a test).

    PYTHONPATH=. python3 benchmarks/probes/reference_gpu_profile.py [--batch 64]

Prints torch.profiler's kernel table for eager decode steps, and the host/GPU split of graphed
steps (time inside the model call vs the whole engine step).
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import tempfile
import time

from torch.profiler import ProfilerActivity, profile

from benchmarks.reference_gpu import LLAMA_8B, generate, write_config
from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine


async def run(eager: bool, root: pathlib.Path, batch: int = 64) -> None:
    model_dir = write_config(root / "llama8b", LLAMA_8B)
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
        num_gpu_blocks=2048, kv_block_size=32, max_batch_size=batch, enforce_eager=eager))
    await engine.start()
    prompts = [[(7 * i + j) % 1000 + 5 for j in range(128)] for i in range(batch)]
    await generate(engine, prompts, 16)  # warm-up, graph capture
    inner: list[float] = []
    original = engine._forward_and_sample

    def timed(*args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = original(*args)
        inner.append(time.perf_counter() - start)
        return out

    engine._forward_and_sample = timed  # type: ignore[method-assign]
    steps0 = engine.num_steps
    start = time.perf_counter()
    if eager:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            await generate(engine, prompts, 24)
    else:
        await generate(engine, prompts, 24)
    wall = time.perf_counter() - start
    steps = engine.num_steps - steps0
    decode = sorted(inner)[len(inner) // 2]
    print(f"\n== {'eager' if eager else 'graphs'} batch {batch}: {steps} steps, "
          f"{1000 * wall / steps:.2f} ms/step wall, forward+sample p50 {1000 * decode:.2f} ms")
    if eager:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
    await engine.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    batch = parser.parse_args().batch
    with tempfile.TemporaryDirectory() as tmp:
        for eager in (False, True):
            await run(eager, pathlib.Path(tmp), batch)


if __name__ == "__main__":
    asyncio.run(main())
