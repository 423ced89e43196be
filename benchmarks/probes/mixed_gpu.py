"""Prefill and decode mixed (issue 25, item 5): the engine in-process under a closed loop.

C streams (concurrency) each send their next request as soon as the last one ended, N requests
of ISL random prompt tokens and OSL output tokens (greedy, ignore_eos), on the Llama-3.1-8B
shape of reference_gpu.py with dummy bf16 weights. So that prefill and decode share steps all
run long, as they do under a served load (requests start while others decode), not one wave of
prefills and then pure decode.

Each variant runs in the same process on the same engine configuration:
  * `batched` (what the engine does): a mixed step's one-token sequences attend in one batch
    (AttentionMetadata.decode_part);
  * `loop` (before): every sequence of a mixed step through the per-sequence attention loop,
    by dropping decode_part from the step's inputs;
  * `full`: as `batched`, with every step computed in full before the next is scheduled
    (--disable-overlap-scheduler; `batched` launches decode steps ahead of their tokens);
for each token budget (`--max-num-tokens`). Also the pure-decode step rate at batch C
(C requests of ISL tokens all at once, the steps after every prefill) for reference.

Prints a markdown table and writes it with every figure as JSON into --out ($OUT by default).

    PYTHONPATH=. python3 benchmarks/probes/mixed_gpu.py             # on a CUDA machine (~4 min)
    PYTHONPATH=. python3 benchmarks/probes/mixed_gpu.py --smoke     # tiny model on the CPU
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks.reference_gpu import BLOCK, LLAMA_8B, SMALL, sync, write_config  # noqa: E402
from benchmarks.serve_load import closed_loop, pct  # noqa: E402


def dropping_decode_part(build):
    """build_step_inputs without the batched decodes of a mixed step (the `loop` variant)."""
    def build_loop(*args, **kwargs):
        inputs = build(*args, **kwargs)
        inputs.meta = dataclasses.replace(inputs.meta, decode_part=None)
        return inputs
    return build_loop


async def pure_decode(engine, isl: int, batch: int, vocab: int) -> float:
    """ms per step of `batch` sequences decoding at context ~ISL (all prompts at once): the
    median gap between a request's tokens past its 32nd, when every prefill is done."""
    from benchmarks.reference_gpu import generate

    rng = random.Random(7)
    prompts = [[rng.randrange(5, vocab - 5) for _ in range(isl)] for _ in range(batch)]
    results = await generate(engine, prompts, 64)
    return 1000 * pct([b - a for _, ts in results for a, b in zip(ts[32:], ts[33:])], 50)


def step_timer(engine) -> list[tuple[bool, int, float]]:
    """Records (decode-only, tokens, seconds) of each forward pass (sampling included, which
    waits for the GPU) of `engine` from now on."""
    steps: list[tuple[bool, int, float]] = []
    forward = engine._forward_and_sample

    def timed(inputs, *args):
        start = time.perf_counter()
        out = forward(inputs, *args)
        steps.append((inputs.meta.is_decode_only, inputs.input_ids.shape[0],
                      time.perf_counter() - start))
        return out

    engine._forward_and_sample = timed
    return steps


def step_summary(steps: list[tuple[bool, int, float]], wall: float) -> dict:
    decode = [t for only, _, t in steps if only]
    mixed = [(n, t) for only, n, t in steps if not only]
    return {"steps": len(steps), "decode_steps": len(decode),
            "decode_step_ms": 1000 * sum(decode) / max(len(decode), 1),
            "mixed_steps": len(mixed),
            "mixed_step_ms": 1000 * sum(t for _, t in mixed) / max(len(mixed), 1),
            "mixed_step_tokens": sum(n for n, _ in mixed) / max(len(mixed), 1),
            "forward_share": sum(t for *_, t in steps) / wall}


async def run(args: argparse.Namespace) -> dict:
    import tandem.engines.reference.engine as reference
    from tandem.engines.args import EngineArgs

    device = "cpu" if args.smoke else "cuda"
    shape = SMALL if args.smoke else LLAMA_8B
    vocab = shape["vocab_size"]
    out: dict = {"shape": "small" if args.smoke else "llama-3.1-8b", "isl": args.isl,
                 "osl": args.osl, "concurrency": args.concurrency, "requests": args.requests,
                 "runs": {}}
    if not args.smoke:
        out["card"] = __import__("torch").cuda.get_device_name()
    built = reference.build_step_inputs
    with tempfile.TemporaryDirectory() as tmp:
        model = write_config(pathlib.Path(tmp) / "model", shape)
        blocks = -(-args.concurrency * (args.isl + args.osl) // BLOCK) + 256
        for budget in args.max_num_tokens:
            engine = reference.create_reference_engine(EngineArgs(
                model=str(model), device=device, dtype="bfloat16" if not args.smoke else "auto",
                load_format="dummy", num_gpu_blocks=blocks, kv_block_size=BLOCK,
                max_batch_size=max(args.concurrency, 8), max_num_tokens=budget,
                enable_prefix_caching=False))
            started = time.perf_counter()
            await engine.start()  # CUDA graphs captured, kernels compiled and tuned
            out.setdefault("start_s", {})[str(budget)] = time.perf_counter() - started
            print(f"engine start (budget {budget}): {time.perf_counter() - started:.1f} s",
                  flush=True)
            try:
                # Warm-up: kernels compile, graphs capture, at this load's shapes.
                await closed_loop(engine, args.isl, 8, args.concurrency, args.concurrency,
                                  vocab, seed=99)
                if budget == args.max_num_tokens[0]:
                    out["decode_step_ms"] = await pure_decode(engine, args.isl,
                                                              args.concurrency, vocab)
                    print(f"pure decode, batch {args.concurrency}: "
                          f"{out['decode_step_ms']:.2f} ms/step", flush=True)
                if budget in args.profile:
                    print(f"profile at budget {budget}:", flush=True)
                    print(await profile_steps(engine, args, vocab), flush=True)
                overlap, ahead = engine.overlap, engine.num_steps_ahead
                for variant in args.variants:
                    reference.build_step_inputs = (dropping_decode_part(built)
                                                   if variant == "loop" else built)
                    engine.overlap = None if variant == "full" else overlap
                    steps = step_timer(engine)
                    try:
                        fig = await closed_loop(engine, args.isl, args.osl, args.concurrency,
                                                args.requests, vocab, seed=budget)
                    finally:
                        reference.build_step_inputs = built
                        engine.overlap = overlap
                        del engine._forward_and_sample
                    fig.update(step_summary(steps, fig["wall_s"]))
                    fig["steps_ahead"] = engine.num_steps_ahead - ahead
                    ahead = engine.num_steps_ahead
                    out["runs"][f"{variant}/{budget}"] = fig
                    print(f"{variant:8s} budget {budget:5d}: {fig['tps']:,.0f} tok/s, TTFT p50 "
                          f"{fig['ttft_p50']:.0f} ms, ITL p50 {fig['itl_p50']:.2f} ms p99 "
                          f"{fig['itl_p99']:.2f} ({fig['wall_s']:.1f} s); {fig['decode_steps']} "
                          f"decode steps of {fig['decode_step_ms']:.2f} ms, "
                          f"{fig['mixed_steps']} mixed of {fig['mixed_step_ms']:.1f} ms "
                          f"({fig['mixed_step_tokens']:.0f} tokens); forward passes "
                          f"{100 * fig['forward_share']:.0f}% of the wall time", flush=True)
            finally:
                await engine.close()
    return out


async def profile_steps(engine, args: argparse.Namespace, vocab: int) -> str:
    """Where the host spends a mixed step: cProfile over the model call of every mixed step of
    a short closed loop (it runs in the engine's worker thread), and how long the call takes
    to launch its kernels against the whole forward pass (its sampling waits for the GPU)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    launch: list[float] = []
    whole: list[float] = []
    model_call = engine.model.forward
    forward = engine._forward_and_sample

    def profiled_model(*a, **k):
        if a[2].is_decode_only:
            return model_call(*a, **k)
        start = time.perf_counter()
        out = profiler.runcall(model_call, *a, **k)
        launch.append(time.perf_counter() - start)
        return out

    def timed(inputs, *a):
        start = time.perf_counter()
        out = forward(inputs, *a)
        sync()
        if not inputs.meta.is_decode_only:
            whole.append(time.perf_counter() - start)
        return out

    engine.model.forward, engine._forward_and_sample = profiled_model, timed
    try:
        await closed_loop(engine, args.isl, 16, args.concurrency, args.concurrency + 16,
                          vocab, seed=5)
    finally:
        del engine.model.forward, engine._forward_and_sample
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return (f"{len(whole)} mixed steps: model call (host, launching) "
            f"{1000 * sum(launch) / max(len(launch), 1):.1f} ms, whole forward "
            f"{1000 * sum(whole) / max(len(whole), 1):.1f} ms on average\n{text.getvalue()}")


def table(out: dict) -> str:
    rows = [f"{out['shape']}, {out['concurrency']} streams of {out['isl']}/{out['osl']}, "
            f"{out['requests']} requests; pure decode at batch {out['concurrency']}: "
            f"{out.get('decode_step_ms', float('nan')):.2f} ms/step "
            f"({1000 * out['concurrency'] / out.get('decode_step_ms', float('nan')):,.0f} "
            "tok/s)", "",
            "| attention of a mixed step | token budget | output tok/s | TTFT p50 / p99 ms | "
            "ITL p50 / p99 ms | decode steps: n, ms | mixed steps: n, ms, tokens | "
            "forward share |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, fig in out["runs"].items():
        variant, budget = key.split("/")
        rows.append(f"| {variant} | {budget} | {fig['tps']:,.0f} | {fig['ttft_p50']:.0f} / "
                    f"{fig['ttft_p99']:.0f} | {fig['itl_p50']:.2f} / {fig['itl_p99']:.2f} | "
                    f"{fig['decode_steps']}, {fig['decode_step_ms']:.2f} | "
                    f"{fig['mixed_steps']}, {fig['mixed_step_ms']:.1f}, "
                    f"{fig['mixed_step_tokens']:.0f} | {100 * fig['forward_share']:.0f}% |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--isl", type=int, default=1000)
    parser.add_argument("--osl", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--max-num-tokens", type=int, nargs="+", default=[8192, 2048])
    parser.add_argument("--variants", nargs="+", default=["batched", "full", "loop"],
                        choices=["batched", "full", "loop"])
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="token budgets to profile (torch.profiler) before their runs")
    parser.add_argument("--out", default=os.environ.get("OUT", "mixed_gpu_out"))
    args = parser.parse_args()
    if args.smoke:
        args.isl, args.osl, args.concurrency, args.requests = 48, 8, 4, 8
    out = asyncio.run(run(args))
    text = table(out)
    print(text)
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "mixed_gpu.json").write_text(json.dumps(out, indent=1))
    (path / "mixed_gpu.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
