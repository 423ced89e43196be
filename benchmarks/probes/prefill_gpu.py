"""What a prefill step of the 8B shape costs, on the host and on the device (a tool, not a test).

    PYTHONPATH=. python3 benchmarks/probes/prefill_gpu.py [--profile 1x200]

The served 64-stream burst's first step often holds one 200-token prompt alone, and took ~30 ms
on an H100 (issue 25), against ~5 ms of weights to read and ~5 ms of matmuls. For each batch x
prompt length, requests of one output token go to the engine in process (fresh prompts, so no
prefix hits), and the table gives the time to the token, the time `_forward_and_sample` takes,
the time the model's forward takes to return on the host (its launches: the device still
computes), and the forward's device time (CUDA events). Then torch.profiler over one step of
--profile's shape: the operators by host time, and the kernels by device time.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import pathlib
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.reference_gpu import (
    BLOCK,
    LLAMA_8B,
    SMALL,
    generate,
    prompts_of,
    sync,
    write_config,
)
from tandem.engines.args import EngineArgs
from tandem.engines.reference import warmup
from tandem.engines.reference.engine import create_reference_engine

SHAPES = ((1, 32), (1, 200), (1, 1000), (8, 200), (41, 200))


class Timers:
    """Wraps the engine's step and its model's forward with host and device timers."""

    def __init__(self, engine: Any, cuda: bool) -> None:
        self.cuda = cuda
        self.step: list[float] = []
        self.launch: list[float] = []
        self.device: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        engine._forward_and_sample = self._timed(engine._forward_and_sample, self.step)
        forward = engine.model.forward

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            if not self.cuda:
                out = forward(*args, **kwargs)
                self.launch.append(time.perf_counter() - begin)
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = forward(*args, **kwargs)
            end.record()
            self.launch.append(time.perf_counter() - begin)
            self._events.append((start, end))
            return out

        engine.model.forward = timed_forward

    @staticmethod
    def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            begin = time.perf_counter()
            out = fn(*args)
            into.append(time.perf_counter() - begin)
            return out
        return timed

    def clear(self) -> None:
        sync()
        self.step.clear()
        self.launch.clear()
        self.device.clear()
        self._events.clear()

    def device_ms(self) -> list[float]:
        sync()
        return [start.elapsed_time(end) for start, end in self._events] or [float("nan")]


def p50_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


async def burst_after_singles(model_dir: pathlib.Path, graphs: bool) -> None:
    """12 lone 200-token requests one after another, then two bursts of 30: each burst step's
    time (the first burst's first eager step was 3x the second's in a served run)."""
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
        num_gpu_blocks=1056, kv_block_size=BLOCK, max_batch_size=64, max_num_tokens=8192,
        disable_prefill_graphs=not graphs))
    await engine.start()
    vocab = engine.vocab_size
    for salt in range(12):
        await generate(engine, prompts_of(1, 200, vocab, 5000 + salt), 20)
    timers = Timers(engine, True)
    for burst in range(2):
        timers.clear()
        print(f"== burst {burst} starts", flush=True)
        begin = time.perf_counter()
        await generate(engine, prompts_of(30, 200, vocab, 6000 + burst), 1)
        wall = 1000 * (time.perf_counter() - begin)
        steps = ", ".join(f"{1000 * s:.1f}" for s in timers.step)
        device = ", ".join(f"{d:.1f}" for d in timers.device_ms())
        print(f"prefill graphs {'on' if graphs else 'off'}, burst {burst}: {wall:.1f} ms; "
              f"steps {steps} ms; forward on device {device} ms")
    await engine.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", default="1x200", help="BATCHxLENGTH of the profiled step")
    parser.add_argument("--small", action="store_true", help="a small model on the CPU (smoke)")
    parser.add_argument("--burst", default="",
                        help="only burst_after_singles, for each engine of this list of "
                             "prefill graphs on/off (e.g. off,on,off)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cuda = not args.small
        model_dir = write_config(pathlib.Path(tmp) / "model", SMALL if args.small else LLAMA_8B)
        if args.burst:
            for graphs in (mode == "on" for mode in args.burst.split(",")):
                await burst_after_singles(model_dir, graphs)
                gc.collect()
                torch.cuda.empty_cache()
            return
        engine = create_reference_engine(EngineArgs(
            model=str(model_dir), device="cuda" if cuda else "cpu", dtype="bfloat16",
            load_format="dummy",
            num_gpu_blocks=1056, kv_block_size=BLOCK, max_batch_size=64, max_num_tokens=8192))
        await engine.start()
        vocab = engine.vocab_size
        scratch = engine.kv_cache.shape[2] - 1
        salt = 1000
        for batch, length in SHAPES:  # warm-up: every shape once
            salt += 1
            await generate(engine, prompts_of(batch, length, vocab, salt), 1)
        timers = Timers(engine, cuda)
        name = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"{name}, {'small' if args.small else 'Llama-3.1-8B'} shape, dummy bf16, "
              "one output token\n")
        print("| batch x length | TTFT p50 ms | step p50 ms | forward launch p50 ms "
              "| forward on device p50 ms |")
        print("|---|---:|---:|---:|---:|")
        for batch, length in SHAPES:
            ttft = []
            timers.clear()
            for _ in range(args.repeats):
                salt += 1
                begin = time.perf_counter()
                await generate(engine, prompts_of(batch, length, vocab, salt), 1)
                ttft.append(time.perf_counter() - begin)
            device = timers.device_ms()
            print(f"| {batch} x {length} | {p50_ms(ttft):.2f} | {p50_ms(timers.step):.2f} | "
                  f"{p50_ms(timers.launch):.2f} | {statistics.median(device):.2f} |")
        batch, length = (int(x) for x in args.profile.split("x"))
        # On this thread (the profiler records operators of the thread that entered it): the
        # warm-up's step of `batch` prompts on the scratch block, once unprofiled.
        for profiled in (False, True):
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) if profiled else contextlib.nullcontext() as prof:
                begin = time.perf_counter()
                warmup._run(engine, [warmup._Sequence(length, length, BLOCK, scratch)
                                     for _ in range(batch)])
                sync()
                print(f"{batch} x {length} on the main thread: {1000 * (time.perf_counter() - begin):.2f} ms"
                      f"{' (profiled)' if profiled else ''}")
        averages = prof.key_averages()
        python = cProfile.Profile()
        python.enable()
        warmup._run(engine, [warmup._Sequence(length, length, BLOCK, scratch)
                             for _ in range(batch)])
        sync()
        python.disable()
        print(f"\n== {batch} x {length}: Python functions by own time (cProfile)")
        pstats.Stats(python).sort_stats("tottime").print_stats(30)
        print(f"\n== {batch} x {length}: operators by host time")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
        print(f"\n== {batch} x {length}: by device time")
        print(averages.table(sort_by="self_device_time_total", row_limit=15))
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
