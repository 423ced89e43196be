"""TTFT, aggregated vs disaggregated, on the CPU test model (issue 4, "Benchmarks").

Starts two topologies in turn with `tandem up` (reference engine, CPU, float32) on free loopback
ports: aggregated (frontend, router, one decode worker) and disaggregated (`--disagg`: one prefill
worker and one decode worker; the decode worker reads the prompt's KV over NIXL). For each prompt
length it sends --requests sequential streaming completions of random token ids (distinct per
request, so no prefix-cache hits) with max_tokens = --osl, and measures TTFT (request sent to the
first SSE chunk with text) and the whole request time.

The model is a tiny Llama written by tandem.model.tiny (random weights, fixed seed) with
--layers/--hidden set here, so that a 2,048-token prefill costs tens of milliseconds on CPU and
the transfer's share of TTFT is visible.

Usage (from the repository root):
    .venv/bin/python benchmarks/disagg_ttft.py
    .venv/bin/python benchmarks/disagg_ttft.py --lengths 512 2048 --requests 10
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.topology import free_ports  # noqa: E402


def start(mode: str, model: pathlib.Path, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    http, grpc_port, router, decode, prefill = free_ports(5)
    argv = [sys.executable, "-m", "tandem.cli", "up", "--engine", "reference", "--model",
            str(model), "--device", "cpu", "--http-port", str(http), "--grpc-port",
            str(grpc_port), "--router-port", str(router), "--decode-ports", str(decode),
            "--max-seq-len", "4096", "--log-level", "warning", *extra]
    if mode == "disagg":
        argv += ["--disagg", "--prefill-ports", str(prefill)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, f"http://127.0.0.1:{http}"
    raise RuntimeError(f"{mode} topology did not start (exit {proc.wait()})")


def one_request(url: str, model: str, prompt: list[int], osl: int) -> tuple[float, float]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": osl, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"content-type": "application/json"})
    sent = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if ttft is None and line.startswith("data: {") and '"text"' in line:
                ttft = time.perf_counter() - sent
    assert ttft is not None, "no token arrived"
    return ttft, time.perf_counter() - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--osl", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()

    from tandem.model.tiny import write_tiny_model

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    model = write_tiny_model(workdir / "bench-llama", "llama", seed=0,
                             num_hidden_layers=args.layers, hidden_size=args.hidden,
                             intermediate_size=args.hidden * 3, max_position_embeddings=4096)
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    rng = random.Random(0)
    rows = []
    for mode in ("agg", "disagg"):
        proc, url = start(mode, model, [])
        try:
            one_request(url, model.name, [5] * 16, 2)  # warm-up
            for n in args.lengths:
                ttfts, totals = [], []
                for _ in range(args.requests):
                    prompt = [rng.randrange(4, vocab) for _ in range(n)]
                    ttft, total = one_request(url, model.name, prompt, args.osl)
                    ttfts.append(ttft)
                    totals.append(total)
                rows.append((mode, n, statistics.median(ttfts), min(ttfts),
                             statistics.median(totals)))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(f"model: tiny llama, {args.layers} layers, hidden {args.hidden}, float32, CPU; "
          f"{args.requests} sequential requests per row, osl {args.osl}")
    print(f"{'mode':8} {'prompt':>7} {'TTFT p50 ms':>12} {'TTFT min ms':>12} "
          f"{'request p50 ms':>15}")
    for mode, n, p50, low, total in rows:
        print(f"{mode:8} {n:>7} {p50 * 1000:>12.1f} {low * 1000:>12.1f} {total * 1000:>15.1f}")
    by = {(mode, n): p50 for mode, n, p50, _, _ in rows}
    for n in args.lengths:
        print(f"disagg/agg TTFT at {n} tokens: {by[('disagg', n)] / by[('agg', n)]:.2f}x")


if __name__ == "__main__":
    main()
