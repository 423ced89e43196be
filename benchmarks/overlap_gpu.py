"""Overlap scheduling on a GPU (issues 25 and 26; a script, not a test): decode ITL with steps
launched ahead of their tokens (the default) against steps computed in full
(--disable-overlap-scheduler), in one engine per model, the two modes alternating.

For each model shape (gpt-oss-20b and Llama-3.1-8B, dummy bf16 weights, CUDA graphs, prefix
caching off) and batch: ITL p50 over requests of ~1,000-token contexts; the decode graph's GPU
time alone (back-to-back replays); whether both modes gave the same tokens; and for gpt-oss the
floor of moe_gpu.py (the bytes a step must read over the measured copy bandwidth).

    PYTHONPATH=. python3 benchmarks/overlap_gpu.py            # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/overlap_gpu.py --small    # CPU smoke run of the script
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.moe_gpu import (  # noqa: E402
    GPT_OSS_20B,
    graph_replay_ms,
    routed_experts,
    step_bytes,
)
from benchmarks.moe_gpu import SMALL as SMALL_MOE  # noqa: E402
from benchmarks.reference_gpu import (  # noqa: E402
    LLAMA_8B,
    SMALL,
    copy_bandwidth,
    generate,
    itl_ms,
    prompts_of,
    write_config,
)
from tandem.engines.args import EngineArgs  # noqa: E402
from tandem.engines.reference.engine import create_reference_engine  # noqa: E402

BLOCK = 32


async def measure(name: str, shape: dict, device: str, root: pathlib.Path, batches: list[int],
                  ctx: int, new: int, bw: float) -> list[dict]:
    vocab = shape["vocab_size"]
    engine = create_reference_engine(EngineArgs(
        model=str(write_config(root / name, shape)), device=device, dtype="bfloat16",
        load_format="dummy", num_gpu_blocks=max(batches) * (ctx + new + 64) // BLOCK + 256,
        kv_block_size=BLOCK, max_batch_size=max(batches), max_num_tokens=8192,
        max_seq_len=4096, enable_prefix_caching=False))
    overlap = engine.overlap
    await engine.start()
    await generate(engine, prompts_of(1, 64, vocab), 4)  # warm-up
    rows = []
    for batch in batches:
        await generate(engine, prompts_of(batch, ctx, vocab, 2), 4)
        itl: dict[str, list[float]] = {"full": [], "ahead": []}
        tokens: dict[str, list] = {"full": [], "ahead": []}
        for rep in range(2):
            for mode in ("full", "ahead") if rep == 0 else ("ahead", "full"):
                engine.overlap = overlap if mode == "ahead" else None
                before = engine.num_steps_ahead
                results = await generate(engine, prompts_of(batch, ctx, vocab, 3), new)
                itl[mode].append(statistics.median(itl_ms(t[2:]) for _, t in results))
                tokens[mode].append([t for t, _ in results])
                if mode == "ahead":
                    assert engine.num_steps_ahead - before > new // 2, "no step ran ahead"
        engine.overlap = overlap
        row = {"model": name, "batch": batch, "full_ms": min(itl["full"]),
               "ahead_ms": min(itl["ahead"]), "all_full_ms": itl["full"],
               "all_ahead_ms": itl["ahead"], "replay_ms": graph_replay_ms(engine, batch),
               "same_tokens": tokens["full"][0] == tokens["ahead"][0],
               "full_runs_agree": tokens["full"][0] == tokens["full"][1],
               "ahead_runs_agree": tokens["ahead"][0] == tokens["ahead"][1]}
        if name == "gpt-oss-20b" and device == "cuda":
            experts = await routed_experts(engine, batch, prompts_of(batch, ctx, vocab, 4))
            row["floor_ms"] = 1000 * step_bytes(engine.model, batch, ctx + new / 2,
                                                experts) / bw
        print(json.dumps(row), flush=True)
        rows.append(row)
    await engine.close()
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU smoke run with tiny shapes")
    parser.add_argument("--out", default=os.environ.get("OUT", "overlap_gpu_out"))
    parser.add_argument("--models", nargs="+", default=["gpt-oss-20b", "llama-8b"])
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    shapes = {"gpt-oss-20b": SMALL_MOE if args.small else GPT_OSS_20B,
              "llama-8b": SMALL if args.small else LLAMA_8B}
    batches = [1, 4] if args.small else [1, 16, 64]
    ctx, new = (64, 12) if args.small else (992, 64)
    bw = copy_bandwidth() if device == "cuda" else float("nan")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows += await measure(name, shapes[name], device, pathlib.Path(tmp), batches,
                                  ctx, new, bw)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overlap_gpu.json").write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; ITL p50 (best of 2 alternating runs)\n")
    print("| model | batch | full steps ITL ms | ahead ITL ms | ahead / full | graph replay ms "
          "| ahead / replay | floor ms | ahead / floor | same tokens: full = ahead, full runs, "
          "ahead runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        floor = r.get("floor_ms", float("nan"))
        print(f"| {r['model']} | {r['batch']} | {r['full_ms']:.2f} | {r['ahead_ms']:.2f} | "
              f"{r['ahead_ms'] / r['full_ms']:.2f}x | {r['replay_ms']:.2f} | "
              f"{r['ahead_ms'] / r['replay_ms']:.2f}x | {floor:.2f} | "
              f"{r['ahead_ms'] / floor:.2f}x | {r['same_tokens']}, {r['full_runs_agree']}, "
              f"{r['ahead_runs_agree']} |")


if __name__ == "__main__":
    asyncio.run(main())
