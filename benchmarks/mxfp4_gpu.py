"""gpt-oss with MXFP4 experts kept 4-bit on one GPU (issue 42, item 2; a script, not a test):
the W4A16 grouped GEMMs (moe_kernels with quant.mxfp4.PackedExperts) against the bf16 ones,
and batch-1 decode of the gpt-oss-20b and gpt-oss-120b shapes against their floors.

Dummy weights are drawn on the GPU (`load_format="dummy"` with a config.json that says
`quantization_config: {quant_method: mxfp4}`: random codes, scales near the dummy std), so no
checkpoint is read. Phases, in one process:

1. `layers`: one MoE layer's GPU time (CUDA-graph replays) at 1 token (the routing kernel and
   both GEMMs) for the 20b and 120b expert shapes, bf16 and MXFP4 experts, as bandwidth over
   the active experts' bytes; and a 2,048-token prefill batch of the MXFP4 layer (torch's
   routing and sort, the same GEMMs with more rows per tile) as TFLOP/s.
2. `20b-bf16`, `20b-mxfp4`, `120b-mxfp4`: the engine API with CUDA graphs at batch 1, a
   ~1,000-token context: ITL p50, the decode graph's replay alone, the kernels' busy time (one
   eager step under torch.profiler, the profile in --out), and the floor: the bytes a step
   reads (attention, router and norm weights, the experts the step routes to, counted per
   layer in an eager pass, at their stored size: MXFP4 codes, scales and biases; the
   embedding row; the LM head; the KV) over the measured copy bandwidth; and one 2,048-token
   prefill. Each engine is closed before the next is built (120b's ~65 GB fit one H200).

Prints the tables last; every figure also goes to --out as JSON (mxfp4_gpu.json).

    PYTHONPATH=. python3 benchmarks/mxfp4_gpu.py            # one H100/H200, ~5 min
    PYTHONPATH=. python3 benchmarks/mxfp4_gpu.py --small    # CPU smoke run (tiny shapes)
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.moe_gpu import (  # noqa: E402
    GPT_OSS_20B,
    SMALL,
    figure_log,
    graph_replay_ms,
    profile_step,
    routed_experts,
    step_bytes,
)
from benchmarks.reference_gpu import (  # noqa: E402
    copy_bandwidth,
    generate,
    itl_ms,
    prompts_of,
    sync,
    write_config,
)
from tandem.engines.args import EngineArgs  # noqa: E402
from tandem.engines.reference import moe_kernels  # noqa: E402
from tandem.engines.reference.engine import create_reference_engine  # noqa: E402
from tandem.engines.reference.loader import DUMMY_STD  # noqa: E402
from tandem.engines.reference.moe import GptOssMoeBlock, pack_experts  # noqa: E402
from tandem.engines.reference.quant import mxfp4  # noqa: E402

GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)
SMALL_120B = dict(SMALL, num_local_experts=16)
MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn",
                                           "model.layers.*.mlp.router", "model.embed_tokens",
                                           "lm_head"]}
#: (name, shape, MXFP4 experts, ITL / floor target of issue 42)
ENGINES = (("20b-bf16", "20b", False, None), ("20b-mxfp4", "20b", True, 1.5),
           ("120b-mxfp4", "120b", True, 1.5))
DT = torch.bfloat16


# ---------------------------------------------------------------- 1. one layer

def moe_block(shape: dict, packed: bool) -> GptOssMoeBlock:
    """One gpt-oss MoE layer on the GPU with dummy weights (bf16, or MXFP4 experts drawn as
    the loader draws them)."""
    with torch.device("meta"):
        block = GptOssMoeBlock(shape["hidden_size"], shape["intermediate_size"],
                               shape["num_local_experts"], shape["num_experts_per_tok"], 1.702,
                               shape["swiglu_limit"])
        if packed:
            pack_experts(block)
    block = block.to(DT).to_empty(device="cuda").requires_grad_(False)
    generator = torch.Generator("cuda").manual_seed(0)
    for name, param in block.named_parameters():
        if param.dtype == torch.uint8:
            mxfp4.draw_packed(param, name, DUMMY_STD, generator)
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)
    return block


def layer_times(shapes: dict[str, dict]) -> list[dict]:
    from benchmarks.reference_gpu_kernels import graph_us

    rows = []
    for shape_name, shape in shapes.items():
        for packed in (False, True):
            block = moe_block(shape, packed)
            expert_bytes = sum(p[0].numel() * p.element_size()
                               for p in block.experts.parameters())
            x = torch.randn(1, shape["hidden_size"], device="cuda", dtype=DT)
            us = graph_us(lambda b=block, x=x: b.forward_slots(x), reps=10, replays=20)
            read = shape["num_experts_per_tok"] * expert_bytes
            rows.append({"shape": shape_name, "experts": "mxfp4" if packed else "bf16",
                         "tokens": 1, "us": us, "active_gb": read / 1e9,
                         "tb_s": read / us / 1e6})
            if packed:
                tokens = 2048
                x = torch.randn(tokens, shape["hidden_size"], device="cuda", dtype=DT)
                us = graph_us(lambda b=block, x=x: b.forward_packed(x), reps=3, replays=5)
                flops = (2 * tokens * shape["num_experts_per_tok"] * 3
                         * shape["hidden_size"] * shape["intermediate_size"])
                rows.append({"shape": shape_name, "experts": "mxfp4", "tokens": tokens,
                             "us": us, "tflop_s": flops / us / 1e6})
            del block
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- 2. the engine

async def engine_figures(device: str, root: pathlib.Path, name: str, shape: dict,
                         packed: bool, small: bool, out_dir: pathlib.Path) -> dict:
    ctx, new, plen = (96, 8, 256) if small else (992, 32, 2048)
    config = dict(shape, quantization_config=MXFP4_CONFIG) if packed else shape
    vocab = shape["vocab_size"]
    engine = create_reference_engine(EngineArgs(
        model=str(write_config(root / name, config)), device=device, dtype="bfloat16",
        load_format="dummy", num_gpu_blocks=(ctx + new + plen) // 32 + 64, kv_block_size=32,
        max_batch_size=1, max_num_tokens=max(4096, plen), max_seq_len=4096,
        enable_prefix_caching=False))
    model = engine.model
    fig: dict = {"weights_gb": sum(p.numel() * p.element_size()
                                   for p in model.parameters()) / 1e9,
                 "experts_packed": any(isinstance(m, mxfp4.PackedExperts)
                                       for m in model.modules()),
                 "graphs": engine.graphs is not None, "ctx": ctx + new / 2}
    if device == "cuda":
        fig["allocated_gb"] = torch.cuda.memory_allocated() / 1e9
    try:
        await engine.start()
        await generate(engine, prompts_of(1, 64, vocab), 4)  # warm-up: kernels compile
        await generate(engine, prompts_of(1, ctx, vocab, 2), 4)  # this shape's graphs
        results = await generate(engine, prompts_of(1, ctx, vocab, 3), new)
        fig["itl_ms"] = statistics.median(itl_ms(t[2:]) for _, t in results)
        fig["replay_ms"] = graph_replay_ms(engine, 1)
        experts = await routed_experts(engine, 1, prompts_of(1, ctx, vocab, 4))
        fig["experts_per_layer"] = statistics.mean(experts)
        fig["floor_gb"] = step_bytes(model, 1, fig["ctx"], experts) / 1e9
        if device == "cuda":
            phase_dir = out_dir / name
            phase_dir.mkdir(parents=True, exist_ok=True)
            fig.update(profile_step(engine, 1, phase_dir))
        for reps in range(2):  # one warm-up, then timed
            sync()
            start = time.perf_counter()
            await generate(engine, prompts_of(1, plen, vocab, 10 + reps), 1)
            sync()
            fig["prefill_s"] = time.perf_counter() - start
        fig["prefill_tokens"] = plen
    finally:
        await engine.close()
    return fig


def print_tables(figures: dict, bw: float, device: str) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\ndevice: {name}; copy bandwidth (read + write) {bw / 1e12:.2f} TB/s")
    layers = figures.get("layers")
    if layers:
        print("\nOne MoE layer, GPU time (graph replays):\n\n| shape | experts | tokens | us | "
              "active experts GB | TB/s | TFLOP/s |\n|---|---|---:|---:|---:|---:|---:|")
        for r in layers:
            gb = f"{r['active_gb']:.4f}" if "active_gb" in r else "-"
            tb = f"{r['tb_s']:.2f}" if "tb_s" in r else "-"
            tf = f"{r['tflop_s']:.0f}" if "tflop_s" in r else "-"
            print(f"| {r['shape']} | {r['experts']} | {r['tokens']} | {r['us']:.1f} | {gb} | "
                  f"{tb} | {tf} |")
    print("\nBatch-1 decode (engine API, CUDA graphs), a ~1,000-token context:\n\n"
          "| model | experts packed | weights GB | ITL p50 ms | graph replay ms | kernels' busy "
          "ms (launches) | experts/layer | floor GB | floor ms | ITL / floor | target | "
          "prefill tok/s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for phase, _, _, target in ENGINES:
        fig = figures.get(phase)
        if not fig or "itl_ms" not in fig:
            continue
        floor = 1000 * fig["floor_gb"] * 1e9 / bw
        ratio = fig["itl_ms"] / floor
        busy = f"{fig['kernel_ms']:.2f} ({fig['kernels']})" if "kernel_ms" in fig else "-"
        verdict = "-" if target is None or math.isnan(ratio) else (f"<= {target}x: "
                                              f"{'met' if ratio <= target else 'missed'}")
        prefill = fig.get("prefill_tokens", 0) / fig["prefill_s"] if "prefill_s" in fig else 0
        print(f"| {phase} | {fig['experts_packed']} | {fig['weights_gb']:.1f} | "
              f"{fig['itl_ms']:.2f} | {fig['replay_ms']:.2f} | {busy} | "
              f"{fig['experts_per_layer']:.1f} | {fig['floor_gb']:.2f} | {floor:.2f} | "
              f"{ratio:.2f}x | {verdict} | {prefill:.0f} |")
    bf16, packed = figures.get("20b-bf16"), figures.get("20b-mxfp4")
    if bf16 and packed and "itl_ms" in bf16 and "itl_ms" in packed:
        print(f"\n20b: MXFP4 ITL {packed['itl_ms']:.2f} ms against bf16 {bf16['itl_ms']:.2f} ms "
              f"(bf16 ITL / MXFP4 ITL {bf16['itl_ms'] / packed['itl_ms']:.2f}; issue 42's "
              "bf16 figure on the H200: 2.57 ms)")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU smoke run with tiny shapes")
    parser.add_argument("--phases", nargs="+", default=["layers"] + [e[0] for e in ENGINES],
                        choices=["layers"] + [e[0] for e in ENGINES])
    parser.add_argument("--out", default=os.environ.get("OUT", "mxfp4_gpu_out"),
                        help="folder for the JSON figures and profiles ($OUT by default)")
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    shapes = {"20b": SMALL, "120b": SMALL_120B} if args.small else {"20b": GPT_OSS_20B,
                                                                    "120b": GPT_OSS_120B}
    out_dir = pathlib.Path(args.out)
    figures, log = figure_log(out_dir / "mxfp4_gpu.json")

    if device == "cuda":
        log("bandwidth", {"copy_tb_s": copy_bandwidth() / 1e12})
        if "layers" in args.phases:
            with torch.inference_mode():
                log("layers", layer_times(shapes))
    bw = figures["bandwidth"]["copy_tb_s"] * 1e12 if device == "cuda" else math.nan
    with tempfile.TemporaryDirectory() as tmp:
        for phase, shape_name, packed, _ in ENGINES:
            if phase not in args.phases:
                continue
            log(phase, await engine_figures(device, pathlib.Path(tmp), phase,
                                            shapes[shape_name], packed, args.small, out_dir))
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    if device == "cuda":  # the tiles and decode variants autotuning chose, per shape
        tuner = moe_kernels._expert_gemm_kernel
        log("tiles", {str(key): str(config) for key, config in tuner.cache.items()})
        for key, config in tuner.cache.items():
            print(f"expert GEMM {key}: {config}")
    print_tables(figures, bw, device)


if __name__ == "__main__":
    asyncio.run(main())
