"""The planner's load test (issue 43): `tandem up --engine mock --planner` against a fixed
deployment sized for the peak, under the same ~10-minute load of streamed completions.

    python benchmarks/planner_load.py                  # aggregated, 600 s, 64 streams at peak
    python benchmarks/planner_load.py --disagg         # prefill and decode pools, ISL shift
    python benchmarks/planner_load.py --duration-s 120 # the same profile, scaled down

The load is closed-loop streams (each sends its next request when its last ends), their number
following a profile over the run (fractions of --duration-s): 1 stream, a ramp to the peak, a
hold, a fall, an idle stretch at 2 streams, a burst, then nothing (the planner must return the
pools to their minimum). With --disagg the prompts change from --isl to --isl-after at the
middle of the run (200/200 to 4000/200 by default): the prefill pool's demand follows the
prompt tokens, the decode pool's the streams and their context.

The mock engine runs at speedup 1 (Dynamo's mocker perf model, tandem.engines.mock.timing):
its decode step grows with the tokens its KV pool holds over its capacity, so a small pool
(--num-gpu-blocks) makes one worker miss the ITL target at a handful of streams. The planner
sizes pools from a measured profile of such a worker (`tandem profile`, --measure-profiles).

It samples each pool's workers every second (the router's members, starting and draining ones
included: they hold a GPU) and records every request's TTFT, inter-token gaps and outcome. Then
it prints, for the planned and the fixed run: the share of 30-s windows whose TTFT p90 and ITL
p90 were within the targets (after the first scale-up settled: its new workers serving), the
worker-seconds (planned / fixed), the failed requests, and the time the planned pools took to
return to their minimum after the load stopped. It writes a JSON of everything and a timeline
PNG (workers, streams, TTFT and ITL p90 per window) into --out-dir.

Needs the `bench` extra (matplotlib) and aiohttp.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import pct, prompt_texts  # noqa: E402
from tandem.launcher.supervisor import read_state, state_path  # noqa: E402
from tandem.planner.report import read_report  # noqa: E402
from tandem.runtime.router_status import RouterStatusClient  # noqa: E402

WINDOW_S = 30.0
#: (fraction of the run, streams as a fraction of the peak; "burst" for the burst's level).
#: Linear between points; a step is two points at nearly the same time.
SHAPE: list[tuple[float, float | str]] = [
    (0.00, 0.0), (0.05, 0.0),      # 1 stream (the floor below)
    (0.30, 1.0), (0.42, 1.0),      # ramp to the peak, hold
    (0.50, 0.2), (0.56, 0.0),      # fall
    (0.63, 0.0),                   # idle stretch (the floor)
    (0.635, "burst"), (0.72, "burst"),
    (0.725, "stop"), (1.00, "stop")]  # the load stops; the pools must shrink to their minimum
FLOOR_STREAMS = 2
START_STREAMS = 1
PROFILES = ROOT / "benchmarks" / "history" / "data" / "planner" / "profiles"


@dataclasses.dataclass
class Shape:
    duration_s: float
    peak: int
    burst: int

    def streams(self, t: float) -> int:
        """Streams wanted at `t` seconds into the run."""
        x = t / self.duration_s
        points = [(f, self._level(v, f)) for f, v in SHAPE]
        if x >= points[-1][0]:
            return int(points[-1][1])
        for (f0, v0), (f1, v1) in zip(points, points[1:]):
            if f0 <= x < f1:
                return round(v0 + (v1 - v0) * (x - f0) / (f1 - f0))
        return START_STREAMS

    def stop_s(self) -> float:
        """When the load stops (no new request after it)."""
        return next(f for f, v in SHAPE if v == "stop") * self.duration_s

    def _level(self, v: float | str, f: float) -> float:
        if v == "stop":
            return 0
        if v == "burst":
            return self.burst
        floor = START_STREAMS if f < 0.1 else FLOOR_STREAMS
        return max(floor, float(v) * self.peak)


# ---- the deployment ---------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclasses.dataclass
class Deployment:
    proc: subprocess.Popen[str]
    http_url: str
    router_port: int
    model: str
    log_path: pathlib.Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The mock engine's flags, the same for the planned, fixed and profiled workers."""
    flags = ["--speedup-ratio", "1", "--num-gpu-blocks-override", str(args.num_gpu_blocks)]
    if args.disagg:
        # Prompts computed in chunks of 128 tokens, each chunk paying the perf model's fixed
        # 16.5 ms: a 4000-token prompt takes ~590 ms of a prefill worker, so that a few long
        # prompts a second need more than one (unchunked it takes 84 ms).
        flags += ["--max-seq-len", str(max(args.isl, args.isl_after) + args.osl + 64),
                  "--max-num-tokens", "128"]
    return flags


def write_plan(args: argparse.Namespace, work: pathlib.Path) -> pathlib.Path:
    if args.disagg:
        pools = [{"name": "prefill", "role": "prefill", "ttft_target_ms": args.ttft_target_ms,
                  "min_workers": 1, "max_workers": args.max_workers,
                  "profile": str(PROFILES / "prefill.json")},
                 {"name": "decode", "role": "decode", "itl_target_ms": args.itl_target_ms,
                  "min_workers": 1, "max_workers": args.max_workers,
                  "profile": str(PROFILES / "decode.json")}]
    else:
        pools = [{"name": "decode", "role": "agg", "ttft_target_ms": args.ttft_target_ms,
                  "itl_target_ms": args.itl_target_ms, "min_workers": 1,
                  "max_workers": args.max_workers, "profile": str(PROFILES / "agg.json")}]
    plan = {"interval_s": args.interval_s, "scale_up_check_s": args.scale_up_check_s,
            "gpu_budget": args.gpu_budget, "pools": pools}
    path = work / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    return path


def start(args: argparse.Namespace, work: pathlib.Path, planned: bool) -> Deployment:
    """`tandem up` on free ports: 1 worker per pool with --planner, else the fixed sizes."""
    num_decode = 1 if planned else args.fixed_decode
    num_prefill = (1 if planned else args.fixed_prefill) if args.disagg else 0
    http, grpc_port, router, *workers = free_ports(3 + num_decode + num_prefill)
    argv = [sys.executable, "-m", "tandem.cli", "up", "--engine", "mock",
            "--http-port", str(http), "--grpc-port", str(grpc_port),
            "--router-port", str(router),
            "--decode-ports", *map(str, workers[:num_decode]),
            "--frontend-processes", "1", "--grace-period-s", "60", *engine_flags(args)]
    if args.disagg:
        argv += ["--disagg", "--prefill-ports", *map(str, workers[num_decode:])]
    if args.prefill_queue_tokens:
        argv += ["--frontend-prefill-queue-tokens", str(args.prefill_queue_tokens)]
    if planned:
        argv += ["--planner", "--planner-config", str(write_plan(args, work))]
    log_path = work / ("planned.log" if planned else "fixed.log")
    log = log_path.open("w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not ready and line.startswith("READY "):
                ready.append(line)
            log.write(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 180
    while not ready:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"tandem up did not become ready; see {log_path}")
        time.sleep(0.2)
    fields = dict(item.split("=", 1) for item in ready[0].split()[1:])
    return Deployment(proc, f"http://127.0.0.1:{http}", router, fields["model"], log_path)


# ---- the load -------------------------------------------------------------------------------

@dataclasses.dataclass
class Request:
    start: float
    isl: int
    first: float | None = None
    end: float | None = None
    #: Arrival times of the streamed chunks after the first.
    chunks: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    error: str = ""


class Load:
    """Closed-loop streams whose number follows the shape; times are seconds since `t0`."""

    def __init__(self, args: argparse.Namespace, url: str, model: str, shape: Shape) -> None:
        self.args, self.url, self.model, self.shape = args, url, model, shape
        self.requests: list[Request] = []
        self.texts = {isl: prompt_texts(32, isl - 8, args.seed + isl, 0)
                      for isl in {args.isl, args.isl_after}}
        self.t0 = 0.0
        self._serial = 0

    def isl_at(self, t: float) -> int:
        after = self.args.disagg and t >= self.args.shift_at * self.shape.duration_s
        return self.args.isl_after if after else self.args.isl

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, session: Any) -> None:
        streams: list[asyncio.Task[None]] = []
        while self.now() < self.shape.duration_s:
            if len(self.requests) >= 20 and all(r.error for r in self.requests[-20:]):
                raise RuntimeError(f"20 requests in a row failed: {self.requests[-1].error}")
            want = self.shape.streams(self.now())
            streams = [s for s in streams if not s.done()]
            for index in range(len(streams), want):
                streams.append(asyncio.create_task(self._stream(session, index)))
            await asyncio.sleep(0.1)
        await asyncio.gather(*streams)

    async def _stream(self, session: Any, index: int) -> None:
        while index < self.shape.streams(self.now()) and self.now() < self.shape.duration_s:
            await self._one(session)

    async def _one(self, session: Any) -> None:
        t = self.now()
        isl = self.isl_at(t)
        self._serial += 1
        # A distinct first word per request: no prompt reuses another's cached KV blocks.
        text = f"r{self._serial} " + random.choice(self.texts[isl])
        req = Request(t, isl)
        self.requests.append(req)
        body = {"model": self.model, "prompt": text, "max_tokens": self.args.osl, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    req.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for raw in resp.content:
                    if not raw.startswith(b"data:") or raw.startswith(b"data: [DONE]"):
                        continue
                    now = self.now()
                    if b'"usage":{' in raw or b'"usage": {' in raw:
                        req.tokens = json.loads(raw[5:])["usage"]["completion_tokens"]
                    if b'"text":""' in raw or b'"choices":[]' in raw:
                        continue
                    if req.first is None:
                        req.first = now
                    else:
                        req.chunks.append(now)
                    if b'"error"' in raw:
                        req.error = raw[5:].decode()[:200]
        except Exception as exc:  # noqa: BLE001 (every failure is a failed request)
            req.error = f"{type(exc).__name__}: {exc}"
        req.end = self.now()
        if not req.error and req.tokens != self.args.osl:
            req.error = f"{req.tokens} of {self.args.osl} tokens"


async def sample_workers(router: str, shape: Shape, t0: float, status: str,
                         stop: Any) -> dict[str, Any]:
    """Each second: every pool's members and candidates (router), the streams the shape
    wants, the planner's decisions (its report), until `stop` (a multiprocessing.Event) is set;
    times since `t0` (time.monotonic(), system-wide)."""
    samples: list[dict[str, Any]] = []
    decisions: dict[str, Any] = {}
    async with RouterStatusClient(router) as client:
        while not stop.is_set():
            t = time.monotonic() - t0
            try:
                pools = await client.list_workers(timeout_s=5)
            except Exception:  # noqa: BLE001 (a busy router: try next second)
                pools = None
            if pools is not None:
                samples.append({"t": t, "streams": shape.streams(t),
                                "members": {p.name: len(p.workers) for p in pools},
                                "candidates": {p.name: sum(w.candidate for w in p.workers)
                                               for p in pools}})
            if status and (body := read_report(status)):
                for d in body.get("decisions", []):
                    decisions.setdefault(f"{body.get('pid')}:{d['interval']}:{d['at']}",
                                        {**d, "t": t})
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - t)))
    return {"samples": samples,
            "decisions": sorted(decisions.values(), key=lambda d: d["t"])}


def _sampler_process(router: str, shape: Shape, t0: float, status: str, stop: Any,
                     conn: Any) -> None:
    conn.send(asyncio.run(sample_workers(router, shape, t0, status, stop)))


async def drive(args: argparse.Namespace, dep: Deployment) -> dict[str, Any]:
    """The load against `dep`, and its workers sampled by another process (the client's
    event loop is busy: a sampler in it would fall behind)."""
    import aiohttp

    shape = Shape(args.duration_s, args.peak_streams, args.burst_streams)
    load = Load(args, dep.http_url, dep.model, shape)
    state = read_state(state_path(dep.router_port)) or {}
    status = str(state.get("planner_status") or "")
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    receive, send = ctx.Pipe(duplex=False)
    load.t0 = time.monotonic()
    sampler = ctx.Process(target=_sampler_process, args=(
        f"127.0.0.1:{dep.router_port}", shape, load.t0, status, stop, send), daemon=True)
    sampler.start()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as session:
            await load.run(session)
    finally:
        stop.set()
    sampled = receive.recv()
    sampler.join()
    return {"requests": [dataclasses.asdict(r) for r in load.requests], **sampled,
            "stop_s": shape.stop_s()}


# ---- the figures ------------------------------------------------------------------------------

def windows(run: dict[str, Any], duration_s: float) -> list[dict[str, Any]]:
    """Per 30-s window: requests whose first token came in it, their TTFT p90; the gaps
    between chunks that came in it, their p90; the mean streams and workers."""
    out = []
    for i in range(int(duration_s // WINDOW_S)):
        lo, hi = i * WINDOW_S, (i + 1) * WINDOW_S
        ttfts = [1000 * (r["first"] - r["start"]) for r in run["requests"]
                 if r["first"] is not None and lo <= r["first"] < hi]
        gaps = []
        for r in run["requests"]:
            times = ([r["first"]] if r["first"] is not None else []) + r["chunks"]
            gaps += [1000 * (b - a) for a, b in zip(times, times[1:]) if lo <= b < hi]
        inside = [s for s in run["samples"] if lo <= s["t"] < hi]
        out.append({"start_s": lo, "requests": len(ttfts),
                    "ttft_p90_ms": pct(ttfts, 90) if ttfts else None,
                    "itl_p90_ms": pct(gaps, 90) if gaps else None,
                    "streams": _mean([s["streams"] for s in inside]),
                    "workers": _mean([sum(s["members"].values()) for s in inside])})
    return out


def summarize(args: argparse.Namespace, run: dict[str, Any], planned: bool) -> dict[str, Any]:
    samples = run["samples"]
    total = [sum(s["members"].values()) for s in samples]
    wins = windows(run, args.duration_s)
    settled = 0.0
    if planned:
        settled = first_scale_up_settled(samples)
    judged = [w for w in wins if w["start_s"] >= settled and w["requests"]]
    ok = [w for w in judged if within(args, w)]
    failed = [r for r in run["requests"] if r["error"]]
    # Worker-seconds over the run: the members (starting, serving, draining) each second.
    worker_s = sum(n * (b["t"] - a["t"]) for n, a, b in zip(total, samples, samples[1:]))
    minimum = len(samples[0]["members"])  # min_workers 1 per pool
    back = None
    if planned:
        for s, n in zip(samples, total):
            if s["t"] >= run["stop_s"] and n == minimum:
                back = s["t"] - run["stop_s"]
                break
    return {"windows": wins, "settled_s": settled, "windows_judged": len(judged),
            "windows_within": len(ok),
            "windows_within_pct": 100 * len(ok) / len(judged) if judged else None,
            "worker_seconds": worker_s, "requests": len(run["requests"]),
            "failed": len(failed), "failures": sorted({r["error"] for r in failed})[:10],
            "max_workers": {p: max(s["members"].get(p, 0) for s in samples)
                            for p in samples[0]["members"]},
            "back_to_min_s": back,
            "back_to_min_intervals": None if back is None else back / args.interval_s}


def first_scale_up_settled(samples: list[dict[str, Any]]) -> float:
    """When the workers of the first scale-up all serve: the first sample with more members
    than the run started with, then the first at which as many are candidates."""
    start = sum(samples[0]["members"].values())
    for i, s in enumerate(samples):
        if (n := sum(s["members"].values())) > start:
            return next((later["t"] for later in samples[i:]
                         if sum(later["candidates"].values()) >= n), samples[-1]["t"])
    return samples[-1]["t"]


def within(args: argparse.Namespace, w: dict[str, Any]) -> bool:
    return ((w["ttft_p90_ms"] is None or w["ttft_p90_ms"] <= args.ttft_target_ms)
            and (w["itl_p90_ms"] is None or w["itl_p90_ms"] <= args.itl_target_ms))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def plot(args: argparse.Namespace, runs: dict[str, dict[str, Any]],
         summaries: dict[str, dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_w, ax_t, ax_i) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    planned = runs["planned"]
    times = [s["t"] for s in planned["samples"]]
    for pool in planned["samples"][0]["members"]:
        ax_w.step(times, [s["members"].get(pool, 0) for s in planned["samples"]], where="post",
                  label=f"planned: {pool} workers")
    if "fixed" in runs:
        fixed = runs["fixed"]["samples"]
        ax_w.step([s["t"] for s in fixed], [sum(s["members"].values()) for s in fixed],
                  where="post", color="grey", linestyle="--", label="fixed: workers")
    ax_w.set_ylabel("workers")
    ax_s = ax_w.twinx()
    ax_s.plot(times, [s["streams"] for s in planned["samples"]], color="black", alpha=0.35,
              label="load: streams")
    ax_s.set_ylabel("streams")
    handles = ax_w.get_legend_handles_labels()[0] + ax_s.get_legend_handles_labels()[0]
    ax_w.legend(handles=handles, loc="upper right", fontsize=8)
    if args.disagg:
        ax_w.axvline(args.shift_at * args.duration_s, color="purple", linestyle=":")
        ax_w.text(args.shift_at * args.duration_s, 0.2, f" ISL {args.isl} -> {args.isl_after}",
                  color="purple", fontsize=8)
    for name, run_summary in summaries.items():
        wins = run_summary["windows"]
        mids = [w["start_s"] + WINDOW_S / 2 for w in wins]
        style = "o-" if name == "planned" else "s--"
        ax_t.plot(mids, [w["ttft_p90_ms"] for w in wins], style, label=f"{name}", markersize=4)
        ax_i.plot(mids, [w["itl_p90_ms"] for w in wins], style, label=f"{name}", markersize=4)
    ax_t.axhline(args.ttft_target_ms, color="red", linestyle=":", label="target")
    ax_i.axhline(args.itl_target_ms, color="red", linestyle=":", label="target")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("TTFT p90 per 30 s (ms)")
    ax_i.set_ylabel("ITL p90 per 30 s (ms)")
    ax_i.set_xlabel("seconds")
    for ax in (ax_w, ax_t, ax_i):
        ax.axvline(planned["stop_s"], color="black", linestyle=":", alpha=0.5)
        ax.axvline(summaries["planned"]["settled_s"], color="green", linestyle=":", alpha=0.5)
    ax_t.legend(fontsize=8)
    ax_i.legend(fontsize=8)
    mode = "disaggregated" if args.disagg else "aggregated"
    fig.suptitle(f"Planner load test, {mode}, mock engine at speedup 1 "
                 f"(green: first scale-up settled; black: load stops)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def table(args: argparse.Namespace, summaries: dict[str, dict[str, Any]]) -> str:
    planned = summaries["planned"]
    fixed_ws = (summaries["fixed"]["worker_seconds"] if "fixed" in summaries
                else (args.fixed_decode + args.fixed_prefill * args.disagg) * args.duration_s)
    rows = [("windows within targets (after settle)",
             f"{planned['windows_within']}/{planned['windows_judged']} "
             f"({planned['windows_within_pct'] or 0:.0f}%)", ">= 95%"),
            ("worker-seconds planned / fixed",
             f"{planned['worker_seconds']:.0f} / {fixed_ws:.0f} = "
             f"{planned['worker_seconds'] / fixed_ws:.2f}x", "<= 0.6x"),
            ("failed requests (planned)", f"{planned['failed']} of {planned['requests']}", "0"),
            ("back to minimum after the load stops",
             "never" if planned["back_to_min_s"] is None else
             f"{planned['back_to_min_s']:.0f} s = {planned['back_to_min_intervals']:.1f} "
             "intervals", "<= 3 intervals"),
            ("most workers (planned)", str(planned["max_workers"]), "")]
    if "fixed" in summaries:
        fixed = summaries["fixed"]
        rows.append(("fixed: windows within targets",
                     f"{fixed['windows_within']}/{fixed['windows_judged']} "
                     f"({fixed['windows_within_pct'] or 0:.0f}%)", ""))
        rows.append(("fixed: failed requests", f"{fixed['failed']} of {fixed['requests']}", ""))
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'measure':<{width}} | result | bar |", f"|{'-' * (width + 2)}|---|---|"]
    lines += [f"| {a:<{width}} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------

def measure_profiles(args: argparse.Namespace) -> None:
    """One worker of each role measured by `tandem profile` with the engine flags of the run."""
    PROFILES.mkdir(parents=True, exist_ok=True)
    flags = ["--load-fractions", "0.2", "0.5", "0.8", "1.0", "1.2"]
    short, long = args.isl + args.osl // 2, args.isl_after + args.osl // 2
    runs = {"agg": [["--isls", str(args.isl), "--context-lengths", str(short),
                     "--batch-sizes", "1", "2", "3", "4", "5", "6", "8"]],
            "prefill": [["--isls", str(args.isl), "1000", str(args.isl_after)]],
            # Short contexts reach the ITL target at tens of streams, long ones at a few: two
            # sweeps (the long one's large batches would queue for minutes), one profile.
            "decode": [["--context-lengths", str(short), "--batch-sizes", "1", "8", "16", "32",
                        "48", "64", "96"],
                       ["--context-lengths", str(long), "--batch-sizes", "1", "2", "3", "4",
                        "6", "8"]]}
    for role in (("prefill", "decode") if args.disagg else ("agg",)):
        merged: dict[str, Any] = {}
        for i, sweep in enumerate(runs[role]):
            part = PROFILES / f"{role}.part{i}.json"
            subprocess.run([sys.executable, "-m", "tandem.cli", "profile", "--role", role,
                            "--engine", "mock", "--output", str(part), *flags, *sweep,
                            "--", *engine_flags(args)], check=True, cwd=ROOT)
            body = json.loads(part.read_text())
            part.unlink()
            merged = body if not merged else {
                **merged, "decode": merged["decode"] + body["decode"]}
        (PROFILES / f"{role}.json").write_text(json.dumps(merged, indent=1))


def run_one(args: argparse.Namespace, work: pathlib.Path, planned: bool) -> dict[str, Any]:
    dep = start(args, work, planned)
    try:
        return asyncio.run(drive(args, dep))
    finally:
        code = dep.stop()
        print(f"{'planned' if planned else 'fixed'} deployment stopped: exit code {code}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--peak-streams", type=int, default=16)
    p.add_argument("--burst-streams", type=int, default=12)
    p.add_argument("--interval-s", type=float, default=15.0)
    p.add_argument("--scale-up-check-s", type=float, default=3.0,
                   help="the planner's backlog checks between intervals (0: none)")
    p.add_argument("--max-workers", type=int, default=10, help="per pool")
    p.add_argument("--gpu-budget", type=int, default=0)
    p.add_argument("--ttft-target-ms", type=float, default=0.0,
                   help="p90 TTFT target; 0: 500 ms (aggregated), 1500 ms (--disagg)")
    p.add_argument("--itl-target-ms", type=float, default=30.0)
    p.add_argument("--num-gpu-blocks", type=int, default=0,
                   help="each worker's KV pool; 0: 64 (aggregated), 896 (--disagg)")
    p.add_argument("--shift-at", type=float, default=0.36,
                   help="--disagg: when the prompts change to --isl-after (fraction of the run: "
                        "0.36 is in the peak's hold)")
    p.add_argument("--isl", type=int, default=200)
    p.add_argument("--isl-after", type=int, default=4000, help="--disagg: ISL after the middle")
    p.add_argument("--osl", type=int, default=200)
    p.add_argument("--disagg", action="store_true")
    p.add_argument("--fixed-decode", type=int, default=0,
                   help="the fixed deployment's decode workers (0: the most the planned run had)")
    p.add_argument("--fixed-prefill", type=int, default=0, help="--disagg: its prefill workers")
    p.add_argument("--prefill-queue-tokens", type=int, default=0,
                   help="--disagg: the frontend's late binding of prompts to prefill workers "
                        "(`tandem up --frontend-prefill-queue-tokens`); 0: off")
    p.add_argument("--skip-fixed", action="store_true",
                   help="no fixed run: its worker-seconds are its size x the duration")
    p.add_argument("--measure-profiles", action="store_true",
                   help="measure the workers' profiles (tandem profile) before the runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir",
                   default=str(ROOT / "benchmarks" / "history" / "data" / "planner"))
    p.add_argument("--name", default="", help="file names' stem (default: planner_load[_disagg])")
    args = p.parse_args()
    if args.isl_after == args.isl or not args.disagg:
        args.isl_after = args.isl
    args.ttft_target_ms = args.ttft_target_ms or (1500.0 if args.disagg else 500.0)
    args.num_gpu_blocks = args.num_gpu_blocks or (896 if args.disagg else 64)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or ("planner_load_disagg" if args.disagg else "planner_load")
    work = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    if args.measure_profiles:
        measure_profiles(args)
    runs = {"planned": run_one(args, work, planned=True)}
    # Sized for the peak: as many workers per pool as the planned run needed at its most.
    most = summarize(args, runs["planned"], True)["max_workers"]
    args.fixed_decode = args.fixed_decode or most.get("decode", args.max_workers)
    args.fixed_prefill = args.fixed_prefill or most.get("prefill", args.max_workers)
    if not args.skip_fixed:
        runs["fixed"] = run_one(args, work, planned=False)
    summaries = {k: summarize(args, v, k == "planned") for k, v in runs.items()}
    text = table(args, summaries)
    print(text)
    (out / f"{name}.json").write_text(json.dumps(
        {"args": {**vars(args), "out_dir": os.path.relpath(args.out_dir, ROOT)},
         "summaries": summaries, "runs": {
            k: {"samples": v["samples"], "decisions": v["decisions"], "stop_s": v["stop_s"]}
            for k, v in runs.items()}, "table": text}, indent=1))
    plot(args, runs, summaries, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")


if __name__ == "__main__":
    main()
