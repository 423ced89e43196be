"""Backbone benchmark: the whole local topology (`tandem up --engine mock`) under aiperf load.

For each scenario: start `tandem up`, wait for its READY line, run aiperf (NVIDIA's serving
benchmark client, installed in .venv-bench/ by benchmarks/setup_aiperf.sh) against the OpenAI chat
endpoint with streaming, fixed 200-token prompts and 200-token answers (ignore_eos + min_tokens so
every request produces exactly max_tokens), then stop tandem with SIGINT. Token accounting uses the
server's usage counts (aiperf --use-server-token-count), not client-side re-tokenization.

While aiperf's profiling phase runs, the driver samples the CPU time of every process (tandem's
services, aiperf's services) from /proc and, when it can reach the decode worker, the worker's KV
utilisation u from its KvEvents stream. With the mock engine's timing model (speedup ratio 1) the
engine's own decode step is decode_ms(u) = -25.74 u^2 + 54.01 u + 5.74 (floored at 1 ms), so
ITL(stack) - decode_ms(u) is what the stack adds per token.

Usage (from the repository root):
    benchmarks/setup_aiperf.sh
    .venv/bin/python benchmarks/backbone.py                 # both scenarios
    .venv/bin/python benchmarks/backbone.py --scenarios s0  # speedup 0, 32 streams only
    .venv/bin/python benchmarks/backbone.py --py-spy 10     # also sample tandem with py-spy
Only the standard library is needed, plus tandem's generated stubs for the KV utilisation probe.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _procstats import CpuSampler, KvLoadSampler, profile_with_py_spy  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TANDEM = ROOT / ".venv" / "bin" / "tandem"
AIPERF = ROOT / ".venv-bench" / "bin" / "aiperf"
PY_SPY = ROOT / ".venv-bench" / "bin" / "py-spy"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    speedup_ratio: float
    concurrency: int
    requests: int
    warmup_requests: int


SCENARIOS = {
    "s0": Scenario("speedup0", 0.0, 32, 640, 64),
    "s1": Scenario("speedup1", 1.0, 128, 640, 128),
}


def decode_ms(u: float) -> float:
    """The mock engine's decode step at KV utilisation u, speedup ratio 1 (Dynamo's mocker)."""
    return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


def prefill_ms(tokens: float) -> float:
    """The mock engine's prefill time of a pass computing `tokens` new prompt tokens."""
    return 4.209989e-7 * tokens * tokens + 1.518344e-2 * tokens + 16.50142 if tokens > 0 else 0.0


def engine_model(row: dict, u: dict, speedup: float) -> dict:
    """What the mock's timing model alone accounts for in the measured wall time.

    A pass sleeps (prefill_ms(T) + decode_ms(u)) / speedup. Over the profiling window the engine
    made about S = output tokens / mean running requests passes (the number of KvEventBatch
    messages, one per pass that changed the cache, is a lower bound to check it against); the
    KvEvents stream also tells how many passes prefilled and how many prompts they held. Wall time per pass minus model time per
    pass is what the stack (decode worker loop, streaming, frontend, client) adds to every token.
    """
    tokens, wall_s = row["usage_output_tokens"], row["duration_s"]
    prompt = (row["isl_usage_avg"] or 0.0) - (row["cached_prompt_avg"] or 0.0)
    passes = tokens / max(u["mean_running"], 1.0)
    decode_total = passes * decode_ms(u["mean"])
    prefill_passes, prefilled = u["prefill_passes"], u["prefilled_requests"]
    per_pass = prefilled / prefill_passes if prefill_passes else 0.0
    prefill_total = prefill_passes * prefill_ms(per_pass * prompt)
    wall_per_pass = 1000.0 * wall_s / passes
    model_per_pass = (decode_total + prefill_total) / speedup / passes
    return {
        "passes_est": passes,
        "event_batches": u["event_batches"],
        "prefill_passes": prefill_passes,
        "prompts_per_prefill_pass": per_pass,
        "prefill_ms_per_pass_avg": prefill_total / speedup / passes,
        "wall_ms_per_pass": wall_per_pass,
        "model_ms_per_pass": model_per_pass,
        "stack_ms_per_pass": wall_per_pass - model_per_pass,
    }


@dataclasses.dataclass
class Ready:
    http_url: str
    grpc_address: str
    model: str
    tokenizer: str


class TandemUp:
    """`tandem up` as a child process in its own session; stopped with SIGINT like a user would."""

    def __init__(self, scenario: Scenario, args: argparse.Namespace, log_path: pathlib.Path):
        self.cmd = [
            str(args.tandem), "up", "--engine", "mock",
            "--speedup-ratio", f"{scenario.speedup_ratio:g}",
            "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
            *args.tandem_arg,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def start(self) -> Ready:
        print(f"$ {' '.join(self.cmd)}", flush=True)
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, start_new_session=True,
        )
        ready_line: list[str] = []
        seen_ready = threading.Event()

        def drain() -> None:  # keeps reading so tandem never blocks on a full pipe
            assert self.proc is not None and self.proc.stdout is not None
            with open(self.log_path, "w") as log:
                for line in self.proc.stdout:
                    log.write(line)
                    log.flush()
                    self.lines.append(line.rstrip("\n"))
                    if line.startswith("READY ") and not seen_ready.is_set():
                        ready_line.append(line)
                        seen_ready.set()
            seen_ready.set()  # EOF: tandem exited

        threading.Thread(target=drain, daemon=True).start()
        if seen_ready.wait(READY_TIMEOUT_S) and ready_line:
            fields = dict(part.split("=", 1) for part in ready_line[0].split()[1:])
            return Ready(fields["http"], fields["grpc"], fields["model"], fields["tokenizer"])
        self.stop()
        tail = "\n".join(self.lines[-30:])
        raise RuntimeError(f"tandem up gave no READY line (see {self.log_path}):\n{tail}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL to the whole session; returns tandem's exit code."""
        if self.proc is None:
            return None
        for sig, grace in ((signal.SIGINT, STOP_TIMEOUT_S), (signal.SIGTERM, 10.0)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"tandem up did not stop {grace:.0f}s after {sig.name}", flush=True)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        try:  # children that outlived their parent, in tandem's own session only
            os.killpg(self.proc.pid, 0)
            print("tandem up left processes behind; killing its process group", flush=True)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode


def aiperf_command(
    scenario: Scenario, ready: Ready, args: argparse.Namespace, artifact_dir: pathlib.Path
) -> list[str]:
    cmd = [
        str(args.aiperf), "profile",
        "--model", ready.model,
        "--url", ready.http_url,
        "--endpoint-type", "chat",
        "--streaming",
        "--concurrency", str(scenario.concurrency),
        "--request-count", str(scenario.requests),
        "--warmup-request-count", str(scenario.warmup_requests),
        "--isl", str(args.isl), "--isl-stddev", "0",
        "--osl", str(args.osl), "--osl-stddev", "0",
        # Every request decodes exactly osl tokens whatever the (mock) model samples.
        "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", f"min_tokens:{args.osl}",
        # Tandem's contract names max_tokens; aiperf would send max_completion_tokens.
        "--use-legacy-max-tokens",
        # A trailing slash makes aiperf load the tokenizer from the local directory.
        "--tokenizer", ready.tokenizer.rstrip("/") + "/",
        # Output tokens from usage.completion_tokens (stream_options.include_usage).
        "--use-server-token-count",
        "--random-seed", "42",
        "--artifact-dir", str(artifact_dir),
        "--ui", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    if args.pacing_rate > 0:
        # Still a closed loop at `concurrency` streams: the rate is far above what the stack
        # serves, so it never binds; it makes aiperf's timing manager wake every 1/rate s instead
        # of spinning on a full set of slots (pure --concurrency mode busy-polls, ~20-30% of a
        # core here, taken from the server on a 2-core machine).
        cmd += ["--request-rate", f"{args.pacing_rate:g}", "--arrival-pattern", "constant"]
    if args.aiperf_workers:
        cmd += ["--workers-max", str(args.aiperf_workers)]
    return cmd + args.aiperf_arg


def profiling_window(artifact_dir: pathlib.Path) -> tuple[float, float]:
    """Wall-clock start and end (s) of aiperf's profiling phase, from its per-request records."""
    starts, ends = [], []
    with open(artifact_dir / "profile_export.jsonl") as records:
        for line in records:
            meta = json.loads(line)["metadata"]
            if meta.get("benchmark_phase") == "profiling":
                starts.append(meta["request_start_ns"])
                ends.append(meta["request_end_ns"])
    return min(starts) / 1e9, max(ends) / 1e9


def summarize(scenario: Scenario, artifact_dir: pathlib.Path) -> dict:
    """One table row from aiperf's JSON export, with usage-based output throughput."""
    data = json.loads((artifact_dir / "profile_export_aiperf.json").read_text())

    def stat(tag: str, key: str = "avg") -> float | None:
        return (data.get(tag) or {}).get(key)

    completed = int(stat("request_count") or 0)
    errors = int(stat("error_request_count") or 0)
    usage_tokens = stat("total_usage_completion_tokens")
    duration_s = stat("benchmark_duration")
    row = {
        "scenario": scenario.name,
        "speedup": scenario.speedup_ratio,
        "concurrency": scenario.concurrency,
        "requests": completed,
        "errors": errors,
        "usage_output_tokens": usage_tokens,
        "duration_s": duration_s,
        # total usage.completion_tokens over the profiling phase's duration (aiperf's own
        # output_token_throughput is total_osl / duration, where osl = usage under
        # --use-server-token-count; both are reported so a disagreement shows).
        "output_tok_s": usage_tokens / duration_s if usage_tokens and duration_s else None,
        "aiperf_output_tok_s": stat("output_token_throughput"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "itl_p99_ms": stat("inter_token_latency", "p99"),
        "itl_avg_ms": stat("inter_token_latency"),
        "latency_p50_ms": stat("request_latency", "p50"),
        "osl_min": stat("output_sequence_length", "min"),
        "osl_max": stat("output_sequence_length", "max"),
        "isl_usage_avg": stat("usage_prompt_tokens"),
        "cached_prompt_avg": stat("usage_prompt_cache_read_tokens"),
    }
    if data.get("error_summary"):
        row["error_summary"] = data["error_summary"]
    return row


def run_scenario(scenario: Scenario, args: argparse.Namespace, out_dir: pathlib.Path) -> dict:
    scenario_dir = out_dir / scenario.name
    scenario_dir.mkdir(parents=True, exist_ok=True)
    for port in (args.http_port, args.grpc_port):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"port {port} is already in use: is another tandem running?")

    tandem = TandemUp(scenario, args, scenario_dir / "tandem.log")
    ready = tandem.start()
    print(f"READY: {ready}", flush=True)
    cpu = CpuSampler(tandem_pid=tandem.pid, interval_s=0.5)
    # The probe is a second subscriber to the decode worker's event stream: only worth its cost
    # where the timing model makes u matter.
    kv = (KvLoadSampler.for_decode_worker(tandem.lines, ready.grpc_address, args.decode_address)
          if scenario.speedup_ratio or args.kv_probe else KvLoadSampler(None))
    try:
        cpu.start()
        kv.start()
        cmd = aiperf_command(scenario, ready, args, scenario_dir / "aiperf")
        print("$ " + " ".join(cmd), flush=True)
        with open(scenario_dir / "aiperf.log", "w") as log:
            aiperf = subprocess.Popen(cmd, cwd=scenario_dir, stdout=log, stderr=subprocess.STDOUT)
            if args.py_spy:
                profile_with_py_spy(
                    PY_SPY, tandem.pid, scenario_dir, args.py_spy, delay_s=args.py_spy_delay,
                    native=args.py_spy_native)
            rc = aiperf.wait(timeout=args.aiperf_timeout)
        cpu.stop()
        kv.stop()
    finally:
        tandem_rc = tandem.stop()
        cpu.stop()
        kv.stop()
    print(f"aiperf exit {rc}, tandem up exit {tandem_rc}", flush=True)
    if rc != 0:
        tail = (scenario_dir / "aiperf.log").read_text().splitlines()[-40:]
        raise RuntimeError(f"aiperf failed ({rc}):\n" + "\n".join(tail))

    row = summarize(scenario, scenario_dir / "aiperf")
    if (row["osl_min"], row["osl_max"]) != (args.osl, args.osl):
        # ignore_eos / min_tokens / max_tokens not honoured: the figures are not comparable.
        print(f"WARNING: usage.completion_tokens ranged {row['osl_min']}-{row['osl_max']}, "
              f"expected exactly {args.osl} per request", flush=True)
    row["tandem_exit"] = tandem_rc
    start, end = profiling_window(scenario_dir / "aiperf")
    row["cpu_percent"] = cpu.percent_between(start, end)
    u = kv.utilisation_between(start, end)
    if kv.address and u is None:
        print(f"KV probe on {kv.address} saw no load: {kv.error or 'no WorkerLoad messages'}")
    if u is not None:
        row["kv_u"] = u
        row["decode_ms_at_u_mean"] = decode_ms(u["mean"])
        row["decode_ms_range"] = [decode_ms(u["min"]), decode_ms(u["max"])]
        if scenario.speedup_ratio and row["itl_p50_ms"] is not None:
            step = decode_ms(u["mean"]) / scenario.speedup_ratio
            row["itl_p50_minus_decode_ms"] = row["itl_p50_ms"] - step
            row["engine_model"] = engine_model(row, u, scenario.speedup_ratio)
    (scenario_dir / "summary.json").write_text(json.dumps(row, indent=2))
    return row


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def print_tables(rows: list[dict]) -> None:
    print()
    print("| scenario | concurrency | requests | output tok/s (usage) | TTFT p50 / p99 ms "
          "| ITL p50 / p99 ms | latency p50 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scenario']} | {r['concurrency']} | {r['requests']} | "
              f"{fmt(r['output_tok_s'], ',.0f')} | {fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])} "
              f"| {fmt(r['itl_p50_ms'], '.2f')} / {fmt(r['itl_p99_ms'], '.2f')} "
              f"| {fmt(r['latency_p50_ms'], ',.0f')} | {r['errors']} |")
    for r in rows:
        if "kv_u" in r:
            u = r["kv_u"]
            line = (f"{r['scenario']}: KV utilisation u mean {u['mean']:.3f} (min {u['min']:.3f}, "
                    f"max {u['max']:.3f}, {u['samples']} samples) -> decode_ms(u) "
                    f"{r['decode_ms_at_u_mean']:.2f} ms (range {r['decode_ms_range'][0]:.2f}-"
                    f"{r['decode_ms_range'][1]:.2f})")
            if "itl_p50_minus_decode_ms" in r:
                line += f"; ITL p50 - decode_ms(u) = {r['itl_p50_minus_decode_ms']:.2f} ms"
            print(line)
            if "engine_model" in r:
                m = r["engine_model"]
                print(f"{r['scenario']}: ~{m['passes_est']:.0f} engine passes (mean running "
                      f"{u['mean_running']:.1f}), "
                      f"{m['prefill_passes']} of them prefilling "
                      f"{m['prompts_per_prefill_pass']:.1f} prompts each; wall "
                      f"{m['wall_ms_per_pass']:.2f} ms/pass vs mock model "
                      f"{m['model_ms_per_pass']:.2f} ms/pass (decode_ms(u) + "
                      f"{m['prefill_ms_per_pass_avg']:.2f} ms prefill share) -> the stack adds "
                      f"{m['stack_ms_per_pass']:.2f} ms/pass")
        elif r["speedup"]:
            print(f"{r['scenario']}: KV utilisation not readable; decode_ms(u) ranges from "
                  f"{decode_ms(0):.2f} ms (u=0) to {decode_ms(1):.2f} ms (u=1), "
                  f"{decode_ms(0.5):.2f} ms at u=0.5")
    for r in rows:
        shares = sorted(r["cpu_percent"].items(), key=lambda kv: -kv[1])
        print(f"{r['scenario']} CPU % of one core during profiling: "
              + ", ".join(f"{name} {pct:.0f}" for name, pct in shares if pct >= 1.0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="s0,s1",
                        help="comma list of s0 (speedup 0, 32 streams), s1 (speedup 1, 128 streams)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--requests", type=int, help="override every scenario's request count")
    parser.add_argument("--warmup", type=int, help="override every scenario's warmup count")
    parser.add_argument("--isl", type=int, default=200)
    parser.add_argument("--osl", type=int, default=200)
    parser.add_argument("--pacing-rate", type=float, default=1000.0,
                        help="aiperf --request-rate cap next to --concurrency, requests/s "
                             "(0: aiperf's pure concurrency mode, which busy-polls)")
    parser.add_argument("--aiperf-workers", type=int, default=0,
                        help="aiperf --workers-max (0: aiperf's default, 1 on a 2-core machine)")
    parser.add_argument("--aiperf-timeout", type=float, default=1800.0)
    parser.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                        help="py-spy record each tandem process for this long (perturbs figures)")
    parser.add_argument("--py-spy-delay", type=float, default=15.0,
                        help="seconds after aiperf starts before py-spy records (startup, warmup)")
    parser.add_argument("--py-spy-native", action="store_true",
                        help="py-spy --native: include C frames (grpc core, protobuf, tokenizers)")
    parser.add_argument("--kv-probe", action="store_true",
                        help="read the decode worker's KV utilisation at speedup 0 too")
    parser.add_argument("--decode-address", default="",
                        help="decode worker host:port for the KV utilisation probe (default: "
                             "found in tandem up's output)")
    parser.add_argument("--out-dir", type=pathlib.Path,
                        default=ROOT / ".tandem" / "bench" / time.strftime("%Y%m%d-%H%M%S"))
    parser.add_argument("--tandem", type=pathlib.Path, default=TANDEM)
    parser.add_argument("--aiperf", type=pathlib.Path, default=AIPERF)
    parser.add_argument("--tandem-arg", action="append", default=[],
                        help="extra argument for tandem up (repeatable)")
    parser.add_argument("--aiperf-arg", action="append", default=[],
                        help="extra argument for aiperf profile (repeatable)")
    args = parser.parse_args()

    if not args.aiperf.exists():
        print(f"{args.aiperf} is missing: run benchmarks/setup_aiperf.sh first", file=sys.stderr)
        return 2
    scenarios = []
    for key in args.scenarios.split(","):
        s = SCENARIOS[key.strip()]
        scenarios.append(dataclasses.replace(
            s, requests=args.requests or s.requests, warmup_requests=args.warmup or s.warmup_requests))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"artifacts: {args.out_dir}", flush=True)

    rows = [run_scenario(s, args, args.out_dir) for s in scenarios]
    (args.out_dir / "results.json").write_text(json.dumps(rows, indent=2))
    print_tables(rows)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
