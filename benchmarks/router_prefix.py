"""Router benchmark: KV-aware routing on a prefix-heavy workload (issue 5, "Benchmarks").

For each worker policy (round_robin, least_loaded, kv by default) the script starts, as real
processes on free loopback ports:
  - 8 mock decode workers (`tandem serve decode --engine mock`, timing model on: each engine pass
    sleeps (prefill_ms(uncached prompt tokens) + decode_ms(KV use)) / speedup), each with a small
    KV pool (`--num-gpu-blocks-override`) that holds a few groups' prefixes but not all of them;
  - a router (`tandem serve router --config router.yaml`: one decode pool of the 8 workers, the
    run's policy, `block_size` equal to the workers' `--kv-block-size`);
  - a frontend (`tandem serve frontend`, OpenAI REST) over the demo model's tokenizer/config,
with `--max-seq-len` raised so that 14k-token prompts are accepted. It waits for each to report
SERVING on grpc.health.v1, sends the workload, then stops everything with SIGTERM.

Workload (identical for every policy, from --seed): G groups, each a distinct random prefix
(lengths spread evenly over the input range), every request = its group's prefix + a short unique
random suffix, so inputs span --isl-min..--isl-max tokens; the requests' group order is random
(interleaved, groups recur). Requests go to POST /v1/completions with the prompt as token ids,
max_tokens = --osl, ignore_eos, streaming with usage, from a closed loop of --concurrency clients
(aiohttp). Per request: TTFT (to the first SSE chunk carrying text), ITL ((last - first chunk
time) / (completion tokens - 1)), prompt and cached tokens from `usage`, and the worker from the
`x-tandem-decode-worker` header. Throughput = output tokens (usage) / wall time of the run.

Defaults, and why: speedup 1 (real-time mocker timing; the stack adds ~10 ms per request when idle
and tens of ms under load on a 2-core machine, which at speedup 5+ is as large as a cached prefill
pass and hides the routing effect); 16 groups of 4k-14k-token prefixes over 8 workers of 1,024
blocks x 32 tokens (32k tokens: ~3.5 mean prefixes, active requests included), so no worker can
keep every group but a KV-aware split (2 groups a worker) fits; 240 requests, the first 20 (the
start burst into empty caches) left out of the latency statistics.

Usage (from the repository root; the demo model is generated if missing):
    .venv/bin/python benchmarks/router_prefix.py
    .venv/bin/python benchmarks/router_prefix.py --policies round_robin kv kv:2 kv:4
    .venv/bin/python benchmarks/router_prefix.py --policies kv --requests 80   # a quick look
    .venv/bin/python benchmarks/router_prefix.py --json out.json               # raw per-request
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import tempfile
import time

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_load import pct  # benchmarks/ is this script's sys.path[0]

ROOT = pathlib.Path(__file__).resolve().parents[1]
TANDEM = ROOT / ".venv" / "bin" / "tandem"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


# ---- workload ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    group: int
    prompt: list[int]


def build_workload(args: argparse.Namespace) -> list[Request]:
    """Groups with distinct random prefixes, each request a prefix + unique suffix, random order."""
    rng = random.Random(args.seed)
    lo, hi = args.isl_min, args.isl_max - args.suffix_max
    groups = args.groups
    # Prefix lengths spread evenly over the range (then shuffled) so every run has the same mix.
    lengths = [lo + round((hi - lo) * g / max(groups - 1, 1)) for g in range(groups)]
    rng.shuffle(lengths)
    # Token ids 10..vocab-1 of the demo model (4096): clear of its special tokens (0..4).
    prefixes = [[rng.randrange(10, args.vocab) for _ in range(n)] for n in lengths]
    order = [i % groups for i in range(args.requests)]
    rng.shuffle(order)
    requests = []
    for i, g in enumerate(order):
        suffix = [rng.randrange(10, args.vocab)
                  for _ in range(rng.randint(args.suffix_min, args.suffix_max))]
        requests.append(Request(i, g, prefixes[g] + suffix))
    return requests


# ---- processes -----------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def wait_serving(address: str, deadline: float) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        replies = stub.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True,
                             timeout=max(deadline - time.monotonic(), 1.0))
        for reply in replies:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                replies.cancel()
                return
    raise RuntimeError(f"{address} did not become SERVING")


def cpu_ticks(pid: int) -> int:
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    values = [int(v) for v in pathlib.Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class Topology:
    """Workers, router and frontend of one policy run; each its own process, logs in `logdir`."""

    def __init__(self, args: argparse.Namespace, policy: str, model_dir: str,
                 logdir: pathlib.Path) -> None:
        self.args, self.policy, self.model_dir, self.logdir = args, policy, model_dir, logdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        ports = free_ports(args.workers + 3)
        self.worker_addresses = [f"127.0.0.1:{p}" for p in ports[:args.workers]]
        self.router_address = f"127.0.0.1:{ports[-3]}"
        self.http_port, self.grpc_port = ports[-2], ports[-1]
        self.http_url = f"http://127.0.0.1:{self.http_port}"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.logdir / f"{self.policy}-{name}.log", "wb")
        proc = subprocess.Popen([str(TANDEM), *argv], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append((name, proc))

    def start(self) -> None:
        a = self.args
        deadline = time.monotonic() + START_TIMEOUT_S
        for i, address in enumerate(self.worker_addresses):
            self._spawn(f"decode{i}", [
                "serve", "decode", "--port", address.rsplit(":", 1)[1], "--engine", "mock",
                "--model", self.model_dir, "--speedup-ratio", f"{a.speedup:g}",
                "--kv-block-size", str(a.block_size),
                "--num-gpu-blocks-override", str(a.num_blocks),
                "--max-seq-len", str(a.max_seq_len), "--log-level", "warning",
                "--load-interval-ms", str(a.load_interval_ms), "--grace-period-s", "2"])
        for address in self.worker_addresses:
            wait_serving(address, deadline)
        config = self.logdir / f"{self.policy}-router.yaml"
        # "kv:2" is the kv policy with prefill_load_scale 2 (a pool option of the router config).
        name, _, scale = self.policy.partition(":")
        pool = {"name": "decode", "kind": "decode", "workers": self.worker_addresses,
                "policy": name, "temperature": a.temperature}
        # Without kv:S or --prefill-load-scale the router's own default applies.
        if scale or a.prefill_load_scale is not None:
            pool["prefill_load_scale"] = float(scale) if scale else a.prefill_load_scale
        config.write_text(json.dumps({"block_size": a.router_block_size or a.block_size,
                                      "pools": [pool]}, indent=1))  # JSON is YAML
        self._spawn("router", ["serve", "router", "--config", str(config),
                               "--port", self.router_address.rsplit(":", 1)[1],
                               "--log-level", "warning", "--grace-period-s", "2"])
        self._spawn("frontend", [
            "serve", "frontend", "--router-address", self.router_address,
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
            "--model", self.model_dir, "--max-seq-len", str(a.max_seq_len),
            "--log-level", "warning", "--grace-period-s", "2"])
        wait_serving(self.router_address, deadline)
        wait_serving(f"127.0.0.1:{self.grpc_port}", deadline)
        # The router serves once one worker is a candidate; give every watcher time to connect
        # its health and KvEvents streams so that all workers are candidates from the start.
        time.sleep(2.0)

    def cpu_ticks(self) -> dict[str, int]:
        return {name: cpu_ticks(p.pid) for name, p in self.procs}

    def stop(self) -> dict[str, int | None]:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name, proc in self.procs:
            try:
                codes[name] = proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only this process
                codes[name] = proc.wait()
        return codes


# ---- client --------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    index: int
    group: int
    isl: int
    ok: bool = False
    error: str = ""
    start_s: float = 0.0
    ttft_s: float = 0.0
    itl_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, model: str, req: Request,
                      osl: int) -> Result:
    res = Result(req.index, req.group, len(req.prompt))
    body = {"model": model, "prompt": req.prompt, "max_tokens": osl, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res.start_s = start
    first = last = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            res.worker = resp.headers.get("x-tandem-decode-worker", "")
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buffer = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        res.error = str(chunk["error"])[:200]
                        return res
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        if first is None:
                            first = now
                        last = now
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = usage["prompt_tokens"]
                        res.completion_tokens = usage["completion_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    end = time.perf_counter()
    res.latency_s = end - start
    if first is None:
        res.error = "no text chunk"
        return res
    res.ttft_s = first - start
    if res.completion_tokens > 1 and last is not None:
        res.itl_s = (last - first) / (res.completion_tokens - 1)
    res.ok = True
    return res


async def run_load(url: str, model: str, requests: list[Request], concurrency: int,
                   osl: int) -> tuple[list[Result], float]:
    """Closed loop: `concurrency` clients take the next request in order as soon as one ends."""
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for req in requests:
        queue.put_nowait(req)
    results: list[Result] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def client() -> None:
            while not queue.empty():
                results.append(await one_request(session, url, model, queue.get_nowait(), osl))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    results.sort(key=lambda r: r.index)
    return results, wall


# ---- report --------------------------------------------------------------------------------

def summarize(policy: str, results: list[Result], wall: float, warmup: int,
              cpu: dict[str, float]) -> dict:
    measured = [r for r in results[warmup:] if r.ok]
    errors = [r for r in results if not r.ok]
    ttft = [r.ttft_s * 1000 for r in measured]
    itl = [r.itl_s * 1000 for r in measured if r.itl_s is not None]
    ratios = [r.cached_tokens / r.prompt_tokens for r in measured if r.prompt_tokens]
    hits = [r.ttft_s * 1000 for r in measured if r.prompt_tokens
            and r.cached_tokens >= 0.5 * r.prompt_tokens]
    misses = [r.ttft_s * 1000 for r in measured if r.prompt_tokens
              and r.cached_tokens < 0.5 * r.prompt_tokens]
    per_worker: dict[str, int] = {}
    for r in results:
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    # Distinct workers each group was served by (affinity: 1 is perfect, 8 is none).
    spread = [len({r.worker for r in results if r.group == g})
              for g in sorted({r.group for r in results})]
    return {
        "policy": policy, "requests": len(results), "measured": len(measured),
        "errors": len(errors), "first_errors": [e.error for e in errors[:3]],
        "wall_s": wall,
        "throughput_tok_s": sum(r.completion_tokens for r in results if r.ok) / wall,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else float("nan"),
        "itl_p50_ms": pct(itl, 50), "itl_mean_ms": statistics.fmean(itl) if itl else float("nan"),
        "cached_ratio_mean": statistics.fmean(ratios) if ratios else float("nan"),
        "hit_share": len(hits) / len(measured) if measured else float("nan"),
        "ttft_hit_p50_ms": pct(hits, 50), "ttft_miss_p50_ms": pct(misses, 50),
        "requests_per_worker": sorted(per_worker.values()),
        "workers_per_group_mean": statistics.fmean(spread) if spread else float("nan"),
        "cpu": cpu,
    }


def print_table(rows: list[dict]) -> None:
    header = ("| policy | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | throughput tok/s | "
              "cached ratio | hit share | TTFT p50 hit / miss ms | req/worker min-max | "
              "workers/group | errors |")
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for r in rows:
        rpw = r["requests_per_worker"]
        print(f"| {r['policy']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
              f"{r['itl_p50_ms']:.2f} | {r['throughput_tok_s']:,.0f} | "
              f"{r['cached_ratio_mean']:.3f} | {r['hit_share']:.2f} | "
              f"{r['ttft_hit_p50_ms']:.1f} / {r['ttft_miss_p50_ms']:.1f} | "
              f"{rpw[0]}-{rpw[-1]} | {r['workers_per_group_mean']:.1f} | {r['errors']} |")
    rr = next((r for r in rows if r["policy"] == "round_robin"), None)
    if rr is None:
        return
    print()
    for kv in (r for r in rows if r["policy"].split(":")[0] == "kv"):
        ratio = kv["ttft_p50_ms"] / rr["ttft_p50_ms"]
        tput = kv["throughput_tok_s"] / rr["throughput_tok_s"]
        met = ratio <= 1 / 3 and tput >= 1.0
        print(f"{kv['policy']} / round_robin: TTFT p50 {ratio:.3f} (target <= 0.333), "
              f"throughput {tput:.3f} (target >= 1.0): {'MET' if met else 'NOT MET'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["round_robin", "least_loaded", "kv"],
                   help="worker policies, one run each; kv:S = kv with prefill_load_scale S")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--speedup", type=float, default=1.0,
                   help="mock engine --speedup-ratio (simulated step time / this)")
    p.add_argument("--block-size", type=int, default=32, help="workers' --kv-block-size")
    p.add_argument("--router-block-size", type=int, default=0,
                   help="router block_size (0: the workers'); a mismatch disables prefix matches")
    p.add_argument("--num-blocks", type=int, default=1024,
                   help="KV pool per worker, blocks (--num-gpu-blocks-override)")
    p.add_argument("--max-seq-len", type=int, default=16384)
    p.add_argument("--prefill-load-scale", type=float, default=None,
                   help="kv pool option (default: the router's)")
    p.add_argument("--temperature", type=float, default=0.0, help="kv pool option")
    p.add_argument("--load-interval-ms", type=int, default=100,
                   help="workers' load report interval (the router's load correction)")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--warmup", type=int, default=20,
                   help="leading requests (the cold-cache start burst) left out of the TTFT, "
                        "ITL, cached-ratio statistics; throughput counts every request")
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--isl-min", type=int, default=4000)
    p.add_argument("--isl-max", type=int, default=14000)
    p.add_argument("--suffix-min", type=int, default=32)
    p.add_argument("--suffix-max", type=int, default=160)
    p.add_argument("--osl", type=int, default=200)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="", help="model dir (default: `tandem demo-model`)")
    p.add_argument("--json", default="", help="write summaries and per-request results here")
    p.add_argument("--logdir", default="", help="service logs (default: a temp dir)")
    args = p.parse_args()

    model_dir = args.model or subprocess.run([str(TANDEM), "demo-model"], check=True,
                                             capture_output=True, text=True).stdout.strip()
    model_name = pathlib.Path(model_dir).name
    logdir = pathlib.Path(args.logdir or tempfile.mkdtemp(prefix="router_prefix-"))
    logdir.mkdir(parents=True, exist_ok=True)
    requests = build_workload(args)
    isls = [len(r.prompt) for r in requests]
    print(f"workload: {len(requests)} requests, {args.groups} groups, input {min(isls)}-"
          f"{max(isls)} tokens (mean {statistics.fmean(isls):.0f}), output {args.osl}, "
          f"concurrency {args.concurrency}, seed {args.seed}; {args.workers} mock workers, "
          f"speedup {args.speedup:g}, {args.num_blocks} blocks x {args.block_size} tokens each; "
          f"logs in {logdir}", flush=True)

    rows, raw = [], {}
    for policy in args.policies:
        topo = Topology(args, policy, model_dir, logdir)
        t0 = time.monotonic()
        try:
            topo.start()
            print(f"[{policy}] started in {time.monotonic() - t0:.1f}s; running load",
                  flush=True)
            ticks0, busy0, me0 = topo.cpu_ticks(), machine_busy(), os.times()
            results, wall = asyncio.run(run_load(topo.http_url, model_name, requests,
                                                 args.concurrency, args.osl))
            ticks1, busy1, me1 = topo.cpu_ticks(), machine_busy(), os.times()
        finally:
            codes = topo.stop()
        hz = os.sysconf("SC_CLK_TCK")
        per = {k: (ticks1[k] - ticks0[k]) / hz / wall for k in ticks0}
        cpu = {"frontend": per["frontend"], "router": per["router"],
               "workers": sum(v for k, v in per.items() if k.startswith("decode")),
               "client": (me1.user + me1.system - me0.user - me0.system) / wall,
               "machine_busy": (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1)}
        row = summarize(policy, results, wall, args.warmup, cpu)
        rows.append(row)
        raw[policy] = [dataclasses.asdict(r) for r in results]
        print(f"[{policy}] {row['requests']} requests in {wall:.1f}s, errors {row['errors']} "
              f"{row['first_errors']}; cpu (cores) frontend {cpu['frontend']:.2f} router "
              f"{cpu['router']:.2f} workers {cpu['workers']:.2f} client {cpu['client']:.2f}, "
              f"machine busy {cpu['machine_busy']:.0%}; exit codes "
              f"{sorted(set(codes.values()), key=str)}", flush=True)
    print()
    print_table(rows)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "summary": rows,
                                                       "results": raw}, indent=1))


if __name__ == "__main__":
    main()
