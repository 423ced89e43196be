"""Frontend processes: `tandem up --engine mock --speedup-ratio 0` with 1, then 2 (or more)
frontend processes sharing the HTTP port, under the same load; throughput, latency and the CPU
time of every process, so that a reader can tell which process is the limit and extrapolate to a
host with more cores.

The mock engine at speedup 0 has no simulated compute, so the serving stack (frontend, router,
workers' gRPC) is all that costs. The load generator runs in its own process (this script with
--loadgen): `--connections` keep-alive connections (the kernel's SO_REUSEPORT hash spreads them
over the frontend processes), each sending streamed /v1/completions (ignore_eos, so every answer
is --max-tokens long) back to back. After --warmup-s it prints a start line, after --duration-s
an end line with what completed in between; the driver reads every process's utime+stime from
/proc/<pid>/stat at those two lines.

Usage (from the repository root):
    .venv/bin/python benchmarks/frontend_processes.py                      # 1 and 2 frontends
    .venv/bin/python benchmarks/frontend_processes.py --frontends 1 2 4 --decode-workers 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._procstats import CLK_TCK, machine_ticks, read_stat  # noqa: E402

READY_TIMEOUT_S = 180


# ---- load generator (its own process) --------------------------------------------------------

@dataclass
class LoadStats:
    requests: int = 0
    output_tokens: int = 0
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


async def _one(session, url: str, body: dict, stats: LoadStats, window: list[float]) -> None:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            stats.errors += 1
            await reply.read()
            return
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    if window[0] <= start and time.perf_counter() <= window[1] and times:
        stats.requests += 1
        stats.output_tokens += tokens
        stats.ttft_s.append(times[0] - start)
        stats.itl_s.extend(b - a for a, b in zip(times, times[1:]))


async def loadgen(args: argparse.Namespace) -> None:
    import aiohttp

    url = args.url + "/v1/completions"
    stats = LoadStats()
    begin = time.perf_counter()
    window = [begin + args.warmup_s, begin + args.warmup_s + args.duration_s]
    connector = aiohttp.TCPConnector(limit=args.connections)

    async def client(i: int) -> None:
        n = 0
        while time.perf_counter() < window[1]:
            body = {"model": args.model, "prompt": f"client {i} request {n} " * 16,
                    "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            await _one(session, url, body, stats, window)
            n += 1

    async def announce() -> None:
        await asyncio.sleep(args.warmup_s)
        print(json.dumps({"event": "start"}), flush=True)

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(announce(), *(client(i) for i in range(args.connections)))
    itl = sorted(stats.itl_s)
    print(json.dumps({"event": "end", "requests": stats.requests, "errors": stats.errors,
                      "output_tokens": stats.output_tokens, "seconds": args.duration_s,
                      "ttft_p50_ms": 1000 * statistics.median(stats.ttft_s or [0]),
                      "itl_p50_ms": 1000 * (itl[len(itl) // 2] if itl else 0)}), flush=True)


# ---- driver ----------------------------------------------------------------------------------

def _cpu_ticks(pid: int) -> int:
    stat = read_stat(pid)
    if stat is None:
        raise RuntimeError(f"process {pid} exited during the measurement")
    return stat[1]


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def label(pid: int) -> str:
    argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    stage = argv[argv.index("serve") + 1]
    if stage == "frontend" and "--own-grpc-port" in argv:
        return f"frontend:{argv[argv.index('--own-grpc-port') + 1]}"
    if stage == "decode":
        return f"decode:{argv[argv.index('--port') + 1]}"
    return stage


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_one(num_frontends: int, args: argparse.Namespace, log: pathlib.Path,
            speedup: float = 0.0, env: dict[str, str] | None = None) -> dict:
    """One `tandem up` under the load; `env` is added to the services' environment (TANDEM_*
    variables set their flags)."""
    http, grpc_port, router, *decode = free_ports(3 + args.decode_workers)
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--engine", "mock", "--speedup-ratio",
         str(speedup),
         "--frontend-processes", str(num_frontends), "--http-port", str(http), "--grpc-port",
         str(grpc_port), "--router-port", str(router), "--decode-ports", *map(str, decode),
         "--router-policy", args.router_policy, "--log-level", "warning",
         "--grace-period-s", "5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("a"), text=True,
        env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        fields: dict[str, str] = {}
        for line in up.stdout:  # type: ignore[union-attr]
            if line.startswith("READY "):
                fields = dict(item.split("=", 1) for item in line.split()[1:])
                break
            if time.monotonic() > deadline:
                break
        if not fields:
            raise RuntimeError(f"tandem up did not become ready (log: {log})")
        services = {label(pid): pid for pid in children_of(up.pid)}
        loadgen_proc = subprocess.Popen(
            [sys.executable, __file__, "--loadgen", "--url", fields["http"], "--model",
             fields["model"], "--connections", str(args.connections), "--warmup-s",
             str(args.warmup_s), "--duration-s", str(args.duration_s), "--max-tokens",
             str(args.max_tokens)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        pids = {**services, "load generator": loadgen_proc.pid}
        assert json.loads(loadgen_proc.stdout.readline())["event"] == "start"  # type: ignore[union-attr]
        before = {name: _cpu_ticks(pid) for name, pid in pids.items()}
        machine_before = machine_ticks()
        end = json.loads(loadgen_proc.stdout.readline())  # type: ignore[union-attr]
        after = {name: _cpu_ticks(pid) for name, pid in pids.items()}
        machine_after = machine_ticks()
        loadgen_proc.wait(timeout=60)
        with urllib.request.urlopen(fields["http"] + "/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        cpu_s = {name: (after[name] - before[name]) / CLK_TCK for name in pids}
        # Busy counts steal here: time the hypervisor took is time these processes waited.
        busy_ticks = [m[0] + m[2] for m in (machine_before, machine_after)]
        busy = (busy_ticks[1] - busy_ticks[0]) / (machine_after[1] - machine_before[1])
        # Everything else on this (shared) machine: other users, loopback softirq, kernel.
        cpu_s["(other, not tandem)"] = max(
            0.0, busy * (os.cpu_count() or 1) * end["seconds"] - sum(cpu_s.values()))
        return {"frontends": num_frontends, **end, "cpu_s": cpu_s, "metrics": metrics}
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)


def print_tables(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nmock engine, speedup 0; {args.decode_workers} decode workers ({args.router_policy}); "
          f"{args.connections} connections; {args.max_tokens} output tokens per request; "
          f"{args.duration_s:.0f} s measured after {args.warmup_s:.0f} s warm-up\n")
    print("| frontend processes | requests/s | output tokens/s | p50 TTFT ms | p50 ITL ms | "
          "errors | CPU s, tandem + load generator |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['frontends']} | {r['requests'] / r['seconds']:.1f} | "
              f"{r['output_tokens'] / r['seconds']:.0f} | {r['ttft_p50_ms']:.1f} | "
              f"{r['itl_p50_ms']:.2f} | {r['errors']} | "
              f"{sum(v for k, v in r['cpu_s'].items() if not k.startswith('(')):.1f} |")
    print("\nCPU per process over the measured window: % of one core, and CPU ms per request\n")
    print("| frontend processes | process | CPU % of a core | CPU ms / request |")
    print("|---|---|---|---|")
    for r in rows:
        for name, seconds in sorted(r["cpu_s"].items()):
            per_request = 1000 * seconds / max(1, r["requests"])
            print(f"| {r['frontends']} | {name} | {100 * seconds / r['seconds']:.0f} | "
                  f"{per_request:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontends", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--router-policy", default="round_robin")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--json", help="also write the rows to this file")
    # The load generator's own mode.
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loadgen:
        asyncio.run(loadgen(args))
        return
    log = pathlib.Path("/tmp/tandem-frontend-processes.log")
    rows = [run_one(n, args, log) for n in args.frontends]
    print_tables(rows, args)
    if args.json:
        rows = [{k: v for k, v in r.items() if k != "metrics"} for r in rows]
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
