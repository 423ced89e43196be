"""Disaggregation against aggregation at equal GPUs (issue 40, item 4), one device call.

The Llama-3.1-8B shape (dummy bf16 weights, the demo tokenizer's vocabulary, as serve_gpu.py)
served by `tandem up` in each topology below, one after the other, with the same requests:

  agg    two aggregated workers, one per GPU (--decode-gpus 0 1), behind the KV router
  1p1d   one prefill worker on GPU 0, one decode worker on GPU 1 (KV over NIXL, NVLink)
  cond   1p1d with conditional disaggregation: prompts of at most --local-prefill tokens are
         prefilled by the decode worker itself (--max-local-prefill-length)

Closed loop (C streams, each sending its next request when its last ends) at each ISL/OSL and
concurrency of --grid, then an open loop at 4000/200 (Poisson arrivals at each --rates value,
requests per second). Per point: TTFT p50/p99, ITL p50/p99 (per request, aiperf's), output
tokens/s per GPU and goodput per GPU: requests per second that met TTFT <= 2 s and their own
ITL p99 <= 25 ms (benchmarks/serve_load.py's `meets_sla`). The table sets each topology against
`agg` point by point; everything goes to --out as JSON.

    PYTHONPATH=. python3 benchmarks/disagg_compare.py               # 2 GPUs (nvidia-h200-x2)
    PYTHONPATH=. python3 benchmarks/disagg_compare.py --smoke       # tiny model on the CPU

On fewer than two GPUs it stops with a message, unless --smoke (then both topologies run on the
CPU, without GPU placement: the script's own check, not a comparison).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.reference_gpu import BLOCK, LLAMA_8B, SMALL  # noqa: E402
from benchmarks.serve_gpu import start_stack, stop_stack, write_model  # noqa: E402
from benchmarks.serve_load import SLA_ITL_MS, SLA_TTFT_MS, drive, open_loop  # noqa: E402

#: (ISL, OSL) -> concurrencies of the closed loop; requests per point: 2 x concurrency.
GRID = {(4000, 200): [16, 64, 128], (1000, 1000): [16, 64, 128], (200, 200): [16, 64, 128]}
SMOKE_GRID = {(40, 8): [2]}
RATES = [2.0, 4.0, 8.0, 12.0, 16.0]


def topology_flags(name: str, args: argparse.Namespace) -> list[str]:
    """`tandem up` flags of a topology (GPU placement left out with --smoke)."""
    port = args.http_port
    gpus = not args.smoke
    if name == "agg":
        return ["--decode-ports", str(port + 200), str(port + 201), "--router-policy", "kv",
                *(["--decode-gpus", "0", "1"] if gpus else [])]
    disagg = ["--disagg", "--prefill-ports", str(port + 300),
              *(["--prefill-gpus", "0", "--decode-gpus", "1"] if gpus else [])]
    if name == "1p1d":
        return disagg
    if name == "cond":
        return [*disagg, "--max-local-prefill-length", str(args.local_prefill)]
    raise SystemExit(f"unknown topology {name!r}: agg, 1p1d or cond")


def kv_blocks(grid: dict) -> int:
    """Blocks per worker for the largest closed-loop point, plus room for the open loop."""
    tokens = max(max(points) * (isl + osl) for (isl, osl), points in grid.items())
    return -(-tokens // BLOCK) + 1024


async def serve(url: str, grid: dict, rates: list[float], args: argparse.Namespace,
                deadline: float) -> dict:
    warm = await drive(url, 64, 8, 2, 2, seed=99, overhead=0)
    overhead = max(0, round(warm["prompt_tokens_mean"]) - 64)
    out: dict = {}
    for (isl, osl), points in grid.items():
        for conc in points:
            key = f"{isl}/{osl}/{conc}"
            if time.monotonic() > deadline:
                out[key] = {"skipped": True}
                continue
            await drive(url, isl, 4, conc, conc, seed=7 + conc, overhead=overhead)  # warm-up
            out[key] = fig = await drive(url, isl, osl, conc, 2 * conc, seed=conc + isl,
                                         overhead=overhead)
            report(key, fig)
    isl, osl = args.rate_shape
    for rate in rates:
        key = f"{isl}/{osl}@{rate:g}/s"
        if time.monotonic() > deadline:
            out[key] = {"skipped": True}
            continue
        n = max(8, int(rate * args.rate_seconds))
        out[key] = fig = await open_loop(url, isl, osl, rate, n, seed=int(rate * 100),
                                         overhead=overhead)
        report(key, fig)
    return out


def report(key: str, fig: dict) -> None:
    print(f"  {key}: {fig['tps']:,.0f} tok/s, TTFT p50/p99 {fig['ttft_p50']:.1f}/"
          f"{fig['ttft_p99']:.1f} ms, ITL p50/p99 {fig['itl_p50']:.2f}/{fig['itl_p99']:.2f} ms, "
          f"SLA met {fig['sla_ok']}/{fig['requests']}, errors {fig['errors']} "
          f"({fig['wall_s']:.1f} s)", flush=True)


def table(results: dict, num_gpus: int) -> str:
    rows = ["| point | topology | tok/s per GPU | goodput per GPU (req/s) | TTFT p50 / p99 ms | "
            "ITL p50 / p99 ms | vs agg: tok/s, goodput, ITL p99 | errors |",
            "|---|---|---:|---:|---:|---:|---|---:|"]
    base = results.get("agg", {})
    for key in next(iter(results.values()), {}):
        for name, served in results.items():
            fig, ref = served.get(key, {}), base.get(key, {})
            if not fig or fig.get("skipped") or "tps" not in fig:
                rows.append(f"| {key} | {name} | skipped | | | | | |")
                continue
            versus = ""
            if name != "agg" and ref and "tps" in ref:
                versus = (f"{fig['tps'] / ref['tps']:.2f}x, "
                          f"{fig['goodput_rps'] / ref['goodput_rps']:.2f}x, "
                          if ref["goodput_rps"] else f"{fig['tps'] / ref['tps']:.2f}x, -, ")
                versus += f"{fig['itl_p99'] / ref['itl_p99']:.2f}x"
            rows.append(f"| {key} | {name} | {fig['tps'] / num_gpus:,.0f} | "
                        f"{fig['goodput_rps'] / num_gpus:.2f} | {fig['ttft_p50']:.1f} / "
                        f"{fig['ttft_p99']:.1f} | {fig['itl_p50']:.2f} / {fig['itl_p99']:.2f} | "
                        f"{versus} | {fig['errors']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--topologies", nargs="+", default=["agg", "1p1d"])
    parser.add_argument("--only", help="ISL/OSL points of the closed loop, e.g. 4000/200")
    parser.add_argument("--concurrency", type=int, nargs="*", help="only these concurrencies")
    parser.add_argument("--rates", type=float, nargs="*", help="open-loop rates, requests/s "
                        f"(default {RATES}; none: no open loop)")
    parser.add_argument("--rate-shape", type=int, nargs=2, default=[4000, 200],
                        metavar=("ISL", "OSL"))
    parser.add_argument("--rate-seconds", type=float, default=20.0,
                        help="each rate's arrivals span about this long")
    parser.add_argument("--local-prefill", type=int, default=512,
                        help="cond: prompts of at most this many uncached tokens stay local")
    parser.add_argument("--budget-s", type=float, default=540,
                        help="skip points that would start past this many seconds")
    parser.add_argument("--max-num-tokens", type=int, default=4096)
    parser.add_argument("--http-port", type=int, default=18000)
    parser.add_argument("--start-timeout-s", type=float, default=240)
    parser.add_argument("--out", default=os.environ.get("OUT", "disagg_compare_out"))
    args = parser.parse_args()
    began = time.monotonic()
    grid = dict(SMOKE_GRID if args.smoke else GRID)
    if args.only:
        grid = {k: v for k, v in grid.items() if f"{k[0]}/{k[1]}" in args.only.split(",")}
    if args.concurrency:
        grid = {k: [c for c in v if c in args.concurrency] for k, v in grid.items()}
    rates = RATES if args.rates is None else args.rates
    if args.smoke:
        args.rate_shape, rates = [40, 8], rates[:1] if args.rates is None else rates
    device_name = "cpu"
    if not args.smoke:
        import torch
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"{torch.cuda.device_count()} GPU(s): the comparison needs two "
                             "(nvidia-h200-x2); --smoke runs the script on the CPU")
        device_name = f"2 x {torch.cuda.get_device_name(0)}"
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = write_model(pathlib.Path(tempfile.mkdtemp(prefix="disagg-compare-")),
                        SMALL if args.smoke else LLAMA_8B)
    stack_args = SimpleNamespace(
        device="cpu" if args.smoke else "cuda", dtype="float32" if args.smoke else "bfloat16",
        max_num_tokens=args.max_num_tokens, http_port=args.http_port, trace=False,
        start_timeout_s=args.start_timeout_s)
    max_batch = max(128, *(c for points in grid.values() for c in points))
    max_seq = max(2048, *(isl + osl + 64 for isl, osl in grid), sum(args.rate_shape) + 64)
    results: dict = {}
    for name in args.topologies:
        flags = topology_flags(name, args)
        log = out_dir / f"tandem_up-{name}.log"
        proc, url = start_stack(model, stack_args, kv_blocks(grid), max_batch, max_seq, log,
                                flags)
        print(f"{name}: READY ({url})", flush=True)
        try:
            results[name] = asyncio.run(serve(url, grid, rates, args, began + args.budget_s))
        finally:
            stop_stack(proc)
    text = table(results, 2)
    (out_dir / "disagg_compare.json").write_text(json.dumps(
        {"device": device_name, "results": results, "table": text,
         "sla": {"ttft_ms": SLA_TTFT_MS, "itl_p99_ms": SLA_ITL_MS}}, indent=1))
    print(f"\n{device_name}, {'small' if args.smoke else 'Llama-3.1-8B'} shape, dummy weights; "
          f"per GPU = over 2 GPUs; goodput: TTFT <= {SLA_TTFT_MS:.0f} ms and ITL p99 <= "
          f"{SLA_ITL_MS:.0f} ms\n\n{text}")


if __name__ == "__main__":
    main()
