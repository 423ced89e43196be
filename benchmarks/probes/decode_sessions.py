"""Decode.Session vs one Decode.Generate call per request, A/B in one run: `tandem up --engine
mock` under the same load with the frontend's --decode-sessions on and off (through
$TANDEM_DECODE_SESSIONS), alternating --repeats times, so that a noisy shared machine moves both
alike. Per variant: throughput, TTFT and ITL p50 (from the load generator of
benchmarks/frontend_processes.py), and the CPU time of every process per 1,000 output tokens.

Usage (from the repository root):
    .venv/bin/python benchmarks/probes/decode_sessions.py                           # speedup 1, 128 streams
    .venv/bin/python benchmarks/probes/decode_sessions.py --speedup 0 --connections 32
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks.frontend_processes import run_one  # noqa: E402

VARIANTS = {"Decode.Session (default)": {"TANDEM_DECODE_SESSIONS": "true"},
            "Decode.Generate per request": {"TANDEM_DECODE_SESSIONS": "false"}}


def _cpu_ms_per_1k(row: dict, name: str) -> float:
    seconds = sum(v for k, v in row["cpu_s"].items() if k.startswith(name))
    return 1e6 * seconds / max(1, row["output_tokens"])


def print_table(rows: dict[str, list[dict]], args: argparse.Namespace) -> None:
    print(f"\nmock engine, speedup {args.speedup}; {args.decode_workers} decode worker(s); "
          f"{args.connections} connections; {args.max_tokens} output tokens per request; "
          f"{args.duration_s:.0f} s measured after {args.warmup_s:.0f} s warm-up; median of "
          f"{args.repeats} alternating runs\n")
    names = ("frontend", "decode", "router")
    print("| variant | output tokens/s | p50 TTFT ms | p50 ITL ms | errors | "
          + " | ".join(f"{n} CPU ms / 1k tokens" for n in names) + " | tandem total |")
    print("|---|---|---|---|---|" + "---|" * (len(names) + 1))
    for variant, runs in rows.items():
        med = statistics.median
        cells = [f"{med(r['output_tokens'] / r['seconds'] for r in runs):.0f}",
                 f"{med(r['ttft_p50_ms'] for r in runs):.1f}",
                 f"{med(r['itl_p50_ms'] for r in runs):.2f}",
                 str(sum(r["errors"] for r in runs))]
        cells += [f"{med(_cpu_ms_per_1k(r, n) for r in runs):.1f}" for n in names]
        cells.append(f"{med(sum(_cpu_ms_per_1k(r, n) for n in names) for r in runs):.1f}")
        print(f"| {variant} | " + " | ".join(cells) + " |")


HOPS = ("engine_to_send", "send_to_receive", "receive_to_sse")


def hop_quantiles(metrics: str, hop: str) -> tuple[float, float, float]:
    """(mean, p50, p90) in ms of tandem_frontend_token_hop_seconds{hop} (the whole run, warm-up
    included); quantiles are the upper bounds of the buckets they fall in."""
    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.labels.get("hop") != hop:
                continue
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    if not count:
        return (0.0, 0.0, 0.0)
    buckets.sort()

    def quantile(q: float) -> float:
        return 1000 * next(le for le, n in buckets if n >= q * count)
    return (1000 * total / count, quantile(0.5), quantile(0.9))


def print_hops(runs: list[dict]) -> None:
    print("\nOne streamed token's latency by hop (Decode.Session runs, the frontend's "
          "tandem_frontend_token_hop_seconds; ms; p50/p90 are bucket upper bounds)\n")
    print("| run | " + " | ".join(f"{h} mean / p50 / p90" for h in HOPS) + " |")
    print("|---|" + "---|" * len(HOPS))
    for i, run in enumerate(runs, 1):
        cells = ["{:.2f} / {:g} / {:g}".format(*hop_quantiles(run["metrics"], h)) for h in HOPS]
        print(f"| {i} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--router-policy", default="round_robin")
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    log = pathlib.Path("/tmp/tandem-decode-sessions.log")
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, env in VARIANTS.items():
            rows[name].append(run_one(1, args, log, args.speedup, env))
    print_table(rows, args)
    print_hops(rows["Decode.Session (default)"])


if __name__ == "__main__":
    main()
