"""The whole stack on a GPU, aggregated (issue 25, item 1): the engine alone, then `tandem up`.

One process, meant for one device call:

1. Writes a model directory: the Llama-3.1-8B shape of reference_gpu.py with the demo tokenizer
   (its 4,096-token vocabulary, so vocab_size 4096: every sampled id must detokenize), dummy
   bf16 weights (`load_format: dummy`).
2. The engine alone, offline, in its own process: for each ISL/OSL and batch B, B requests of
   ISL prompt tokens submitted at once, OSL tokens each (greedy, ignore_eos): output tokens/s
   (prefill included), TTFT and decode ITL (= step time) percentiles.
3. `python -m tandem.cli up --engine reference ...` (frontend, router, one decode worker as
   processes), waits for READY.
4. Streamed `/v1/chat/completions` from an aiohttp load generator (benchmarks/serve_load.py:
   this process, or --client-processes N), at concurrency C in
   {1, 16, 64, 128} for ISL/OSL 200/200 and 1000/1000: distinct random-token prompts of ISL
   tokens (usage.prompt_tokens is recorded), `ignore_eos`, `max_tokens` = OSL.
5. Prints a markdown table (served vs the engine at B = C: efficiency = served output tokens/s
   over the engine's) and writes it with every figure as JSON into --out ($OUT by default).

Disaggregated on the same GPU (one prefill and one decode worker, KV over NIXL: carry the
`nixl/` folder that benchmarks/gpu_wheelhouse.sh builds): `--variant disagg " --disagg
--prefill-ports 18300"` (flags after a space, or argparse takes them for its own).
`--engine-after` runs the engine alone again at one stream after the stack, because its TTFT
there moves between calls by more than the 10% the comparison asks for.

    PYTHONPATH=. python3 benchmarks/serve_gpu.py            # on a CUDA machine (~6 min)
    PYTHONPATH=. python3 benchmarks/serve_gpu.py --smoke    # tiny model on the CPU
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pathlib
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.reference_gpu import BLOCK, LLAMA_8B, SMALL, generate, sync  # noqa: E402
from benchmarks.serve_load import DEMO_VOCAB, drive, pct  # noqa: E402
from tandem.engines.args import EngineArgs  # noqa: E402

#: (ISL, OSL) -> [(concurrency, requests)]: two waves of requests (12 and 6 at one stream).
GRID = {(200, 200): [(1, 12), (16, 32), (64, 128), (128, 256)],
        (1000, 200): [(64, 128)],
        (1000, 1000): [(1, 6), (16, 32), (64, 128), (128, 256)]}
SMOKE_GRID = {(24, 12): [(1, 3), (2, 4)]}


def write_model(root: pathlib.Path, shape: dict) -> pathlib.Path:
    """A model directory: `shape` (vocab_size forced to the demo tokenizer's) with the demo
    model's tokenizer files, chat template and special token ids; no weights (dummy load)."""
    from tandem.model.demo import create_demo_model

    demo = create_demo_model(root / "demo")
    config = json.loads((demo / "config.json").read_text())
    assert config["vocab_size"] == DEMO_VOCAB, config["vocab_size"]
    config.update(shape, vocab_size=DEMO_VOCAB, torch_dtype="bfloat16", tie_word_embeddings=False)
    config["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(demo / name, model / name)
    (model / "config.json").write_text(json.dumps(config, indent=1))
    return model


def kv_blocks(grid: dict) -> int:
    """Blocks for the largest concurrency at the longest ISL + OSL, plus slack."""
    tokens = max(max(c for c, _ in points) * (isl + osl) for (isl, osl), points in grid.items())
    return -(-tokens // BLOCK) + 256


# ---------------------------------------------------------------- the engine alone (offline)

async def offline(model: pathlib.Path, device: str, dtype: str, grid: dict,
                  warmup: bool = True, max_num_tokens: int = EngineArgs.max_num_tokens,
                  quantization: str = "auto", speculative_config: str = "") -> dict:
    """The engine's own figures at every (ISL, OSL, B = concurrency) of the grid."""
    from benchmarks.serve_load import closed_loop
    from tandem.engines.reference.engine import create_reference_engine

    batches = sorted({c for points in grid.values() for c, _ in points})
    engine = create_reference_engine(EngineArgs(
        model=str(model), device=device, dtype=dtype, load_format="dummy",
        num_gpu_blocks=kv_blocks(grid), kv_block_size=BLOCK, max_batch_size=max(batches),
        max_num_tokens=max_num_tokens, enable_prefix_caching=False, quantization=quantization,
        speculative_config=speculative_config))
    await engine.start()
    rng = random.Random(1)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(5, DEMO_VOCAB - 5) for _ in range(length)] for _ in range(n)]

    await generate(engine, prompts(2, 64), 8)  # warm-up (kernels compile)
    out = {}
    for (isl, osl), points in grid.items():
        for batch in sorted({c for c, _ in points}):
            if warmup:  # this shape's first steps (the graphs are captured at start)
                await generate(engine, prompts(batch, isl), 4)
            sync()
            start = time.perf_counter()
            results = await generate(engine, prompts(batch, isl), osl)
            sync()
            wall = time.perf_counter() - start
            ttft = [1000 * (times[0] - start) for _, times in results]
            gaps = [1000 * (b - a) for _, times in results for a, b in zip(times, times[1:])
                    if b > a]
            tokens = sum(len(t) for t, _ in results)
            fig = {"tps": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
                   "step_p50": pct(gaps, 50), "step_p99": pct(gaps, 99), "wall_s": wall}
            print(f"engine {isl}/{osl} batch {batch}: {fig['tps']:,.0f} tok/s, TTFT p50 "
                  f"{fig['ttft_p50']:.1f} ms, step p50 {fig['step_p50']:.2f} ms "
                  f"({wall:.1f} s)", flush=True)
            # The served load in process: the same streams and requests, each stream sending
            # its next request when the last ends (arrivals spread as the stack's are).
            n = max(r for c, r in points if c == batch)
            fig["closed"] = loop = await closed_loop(engine, isl, osl, batch, n, DEMO_VOCAB,
                                                     seed=batch)
            print(f"engine {isl}/{osl} closed loop {batch} x{n}: {loop['tps']:,.0f} tok/s, "
                  f"TTFT p50 {loop['ttft_p50']:.1f} ms, ITL p50 per request "
                  f"{loop['request_itl_p50']:.2f} ms ({loop['wall_s']:.1f} s)", flush=True)
            out[f"{isl}/{osl}/{batch}"] = fig
    await engine.close()
    return out


def offline_in_subprocess(model: pathlib.Path, args: argparse.Namespace,
                          concurrency: list[int] | None = None) -> dict:
    """Runs `offline` in its own process, so that the GPU is whole again for the server
    (`concurrency`: only those points, else --concurrency's)."""
    concurrency = concurrency or args.concurrency
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "offline.json"
        argv = [sys.executable, __file__, "--phase-offline", str(out), "--model", str(model)]
        argv += ["--smoke"] if args.smoke else []
        argv += ["--no-warmup"] if args.no_warmup else []
        argv += ["--max-num-tokens", str(args.max_num_tokens)]
        argv += ["--quantization", args.quantization]
        argv += ["--speculative-config", args.speculative_config]
        argv += ["--only", args.only] if args.only else []
        argv += ["--concurrency", *map(str, concurrency)] if concurrency else []
        subprocess.run(argv, check=True)
        return json.loads(out.read_text())


# ---------------------------------------------------------------- the stack (tandem up)

def start_stack(model: pathlib.Path, args: argparse.Namespace, blocks: int, max_batch: int,
                max_seq: int, log: pathlib.Path,
                extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `tandem up` in a session of its own; returns it and the HTTP base URL once it
    printed READY (raises with the log's tail if it exits or takes too long). Leading words
    of `extra` of the form NAME=VALUE (NAME upper case) go into its environment."""
    extra = list(extra or [])
    assigned = {}
    while extra and "=" in extra[0] and extra[0].split("=", 1)[0].isupper():
        name, value = extra.pop(0).split("=", 1)
        assigned[name] = value
    argv = [sys.executable, "-m", "tandem.cli", "up", "--engine", "reference",
            "--model", str(model), "--served-model-name", "bench",
            "--device", args.device, "--dtype", args.dtype, "--load-format", "dummy",
            "--max-seq-len", str(max_seq), "--num-gpu-blocks-override", str(blocks),
            "--kv-block-size", str(BLOCK), "--max-batch-size", str(max_batch),
            "--max-num-tokens", str(args.max_num_tokens), "--http-port", str(args.http_port),
            "--grpc-port", str(args.http_port + 1), "--router-port", str(args.http_port + 100),
            "--decode-ports", str(args.http_port + 200), "--restart-policy", "no",
            "--grace-period-s", "5", "--log-level", "warning",
            "--quantization", args.quantization,
            *(["--speculative-config", args.speculative_config] if args.speculative_config
              else []), *extra]
    print("$ " + " ".join([*(f"{k}={v}" for k, v in assigned.items()), *argv[1:]]), flush=True)
    handle = log.open("w")
    env = {**os.environ, **assigned}
    if args.trace:  # every span to the log at exit (benchmarks/probes/ttft_split.py reads them)
        env.update(OTEL_TRACES_EXPORTER="console", OTEL_BSP_SCHEDULE_DELAY="3600000",
                   OTEL_BSP_MAX_QUEUE_SIZE="1000000", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1000000")
    proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=tempfile.mkdtemp(prefix="tandem-up-"))
    deadline = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("READY "):
                url = line.split("http=", 1)[1].split()[0]
                return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop_stack(proc)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    raise RuntimeError(f"tandem up did not print READY (exit {proc.poll()}):\n{tail}")


def stop_stack(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stage_pids(root: int) -> dict[str, int]:
    """One process of each Tandem stage under `root` (tandem up), by stage: "frontend",
    "router", "decode", ... (benchmarks._procstats names them)."""
    from benchmarks._procstats import label_processes

    found: dict[str, int] = {}
    for pid, name in sorted(label_processes(root).items()):
        kind, _, stage = name.partition(" ")
        if kind == "tandem" and stage != "up":
            found.setdefault(stage.split("[")[0], pid)
    return found


class Profiles:
    """py-spy on the decode worker and the frontend for one served point (--py-spy): raw
    collapsed stacks with thread names, one file per process under the output folder."""

    def __init__(self, out_dir: pathlib.Path, root: int) -> None:
        self.out_dir, self.root = out_dir, root
        self.running: list[subprocess.Popen] = []

    def start(self, key: str) -> None:
        spy = shutil.which("py-spy")
        if spy is None:
            print("py-spy: not installed, no profile", flush=True)
            return
        for stage, pid in stage_pids(self.root).items():
            if stage not in ("decode", "frontend"):
                continue
            path = self.out_dir / f"py-spy-{key.replace('/', '-')}-{stage}.txt"
            self.running.append(subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--rate", "250", "--nonblocking",
                 "--threads", "--format", "raw", "-o", str(path)],
                stdout=subprocess.DEVNULL, stderr=(self.out_dir / "py-spy.log").open("a")))

    def stop(self) -> None:
        for proc in self.running:
            proc.send_signal(signal.SIGINT)
        for proc in self.running:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.running = []


async def served(url: str, grid: dict, deadline: float, warmup: bool = True,
                 profiles: Profiles | None = None, connections: tuple[str, ...] = ("fresh",),
                 repeat: int = 1, processes: int = 1) -> dict:
    """Each point of the grid, `repeat` times in a row, once per connection mode in turn:
    "fresh" (the load generator connects as its requests go out, inside their TTFT) or "kept"
    (its connections opened before the run), from `processes` client processes.
    A point's figures are its first run's, with every run under "runs"."""
    out: dict = {}
    # Warm-up; the chat template's tokens: usage.prompt_tokens of a 64-token text, less 64.
    warm = await drive(url, 64, 8, 2, 2, seed=99, overhead=0)
    overhead = max(0, round(warm["prompt_tokens_mean"]) - 64)
    out["chat_template_tokens"] = overhead
    for k, ((isl, osl), points) in enumerate(grid.items()):
        for conc, n in points:
            key = f"{isl}/{osl}/{conc}"
            if time.monotonic() > deadline:
                print(f"served {key}: skipped (time budget)", flush=True)
                out[key] = {"skipped": True}
                continue
            # As the engine alone: first `conc` requests of 4 tokens at this shape.
            if warmup:
                await drive(url, isl, 4, conc, conc, seed=7 + conc, overhead=overhead)
            runs: list[dict] = []
            for run, mode in itertools.product(range(1, repeat + 1), connections):
                fig = await serve_point(url, key, (isl, osl, conc, n),
                                        1000 * k + conc + 7919 * len(runs), overhead, deadline,
                                        profiles if not runs else None, mode == "kept",
                                        processes)
                if fig is None:  # timed out: the point's other runs would too
                    break
                runs.append({**fig, "connections": mode, "run": run})
            out[key] = {**runs[0], "runs": runs} if runs else {"skipped": True,
                                                                "timed_out": True}
    return out


async def serve_point(url: str, key: str, point: tuple[int, int, int, int], seed: int,
                      overhead: int, deadline: float, profiles: Profiles | None, kept: bool,
                      processes: int) -> dict | None:
    """One run of one point (drive's `kept` and `processes`); None when it outlived the time
    budget."""
    isl, osl, conc, n = point
    if profiles is not None:
        profiles.start(key)
    try:  # a stalled stack must not eat the call: the point ends with the budget
        fig = await asyncio.wait_for(
            drive(url, isl, osl, conc, n, seed, overhead, kept, processes),
            timeout=max(30.0, deadline - time.monotonic() + 60))
    except asyncio.TimeoutError:
        print(f"served {key}: timed out", flush=True)
        return None
    finally:
        if profiles is not None:
            profiles.stop()
    print(f"served {key} x{n} ({'kept' if kept else 'fresh'} connections, {processes} client "
          f"process(es)): "
          f"{fig['tps']:,.0f} tok/s, TTFT p50/p99 "
          f"{fig['ttft_p50']:.1f}/{fig['ttft_p99']:.1f} ms (first event p50 "
          f"{fig['first_event_p50']:.1f} ms; text a step late in {fig['late_text']}), "
          f"ITL p50/p99 {fig['itl_p50']:.2f}/{fig['itl_p99']:.2f} ms, prompt "
          f"{fig['prompt_tokens_mean']:.0f} tok, errors {fig['errors']} "
          f"{fig['first_error']} ({fig['wall_s']:.1f} s)", flush=True)
    return fig


def alternate(url: str, model: pathlib.Path, args: argparse.Namespace, grid: dict
              ) -> list[dict]:
    """`args.rounds` rounds at one stream, each the engine alone (its own process, beside the
    idle stack) then the stack: the engine's one-stream TTFT moves between calls, so each
    round's ratio compares the two minutes apart on one machine."""
    single = {shape: [p for p in points if p[0] == 1] for shape, points in grid.items()}
    single = {shape: points for shape, points in single.items() if points}
    rounds = []
    for r in range(args.rounds):
        engine = offline_in_subprocess(model, args, [1])
        stack = asyncio.run(served(url, single, time.monotonic() + 600, not args.no_warmup))
        rounds.append({"engine": engine, "stack": stack})
        for (isl, osl) in single:
            key = f"{isl}/{osl}/1"
            e, s = engine[key]["closed"], stack[key]
            print(f"round {r + 1} {key}: TTFT p50 stack {s['ttft_p50']:.1f} / engine "
                  f"{e['ttft_p50']:.1f} ms = {s['ttft_p50'] / e['ttft_p50']:.2f}x; ITL p50 "
                  f"stack {s['itl_p50']:.2f} / engine {e['request_itl_p50']:.2f} ms = "
                  f"{s['itl_p50'] / e['request_itl_p50']:.2f}x", flush=True)
    return rounds


def print_ttft_split(log: pathlib.Path, grid: dict, stack: dict) -> None:
    """--trace: each traced request's TTFT split by hop (benchmarks/probes/ttft_split.py); when the
    stack served one point only, that point's requests with the client's TTFTs, and how each
    run's first wave reached the worker."""
    from benchmarks.probes import ttft_split

    found = ttft_split.spans(log.read_text(errors="replace"))
    rows = ttft_split.split(found)
    keys = [f"{i}/{o}/{c}" for (i, o), points in grid.items() for c, _ in points]
    runs = stack[keys[0]].get("runs", []) if len(keys) == 1 else []
    total = sum(len(r["ttft_ms"]) for r in runs)
    waves = []
    if runs and len(rows) >= total:  # the point's requests came last (probes first)
        rows, wave, at = rows[-total:], next(c for _, points in grid.items() for c, _ in points), 0
        for run in runs:
            part = rows[at:at + len(run["ttft_ms"])]
            at += len(part)
            if wave > 1:
                waves.append(f"run {run['run']}, {run['connections']} connections (TTFT p50 "
                             f"{run['ttft_p50']:.1f} ms), first wave:\n"
                             f"{ttft_split.arrival_table(part, wave)}\n")
        rows = part
        client = runs[-1]["ttft_ms"]
    else:
        client = None
    print(f"TTFT split ({len(rows)} traced requests{', the last run' if client else ''}):\n"
          f"{ttft_split.table(rows, client)}\n{''.join(waves)}engine steps:\n"
          f"{ttft_split.step_table(found)}", flush=True)


def table(grid: dict, engine: dict, stack: dict) -> str:
    """Served against the engine in process: all B requests at once ("batch"), and the served
    load itself ("closed": C streams, each sending its next request when the last ends). ITL
    per request is (last token - first token) / (tokens - 1), as aiperf's; gap p50 is the
    median time between a stream's tokens, against the engine's step p50 (batch)."""
    rows = ["| ISL/OSL | streams | requests | served tok/s | engine tok/s batch / closed | "
            "efficiency (batch / closed) | TTFT p50 ms served / engine closed / batch | "
            "first event p50 ms (requests whose text came later) | "
            "TTFT p99 ms served / closed | ITL p50 per request ms served / closed | "
            "gap p50 ms served / engine step | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (isl, osl), points in grid.items():
        for conc, n in points:
            key = f"{isl}/{osl}/{conc}"
            e, s = engine.get(key, {}), stack.get(key, {})
            c = e.get("closed", {})
            if not s or s.get("skipped") or not c:
                rows.append(f"| {isl}/{osl} | {conc} | {n} | skipped | "
                            f"{e.get('tps', float('nan')):,.0f} | | | | | | | |")
                continue
            rows.append(
                f"| {isl}/{osl} | {conc} | {n} | {s['tps']:,.0f} | {e['tps']:,.0f} / "
                f"{c['tps']:,.0f} | {s['tps'] / e['tps']:.0%} / {s['tps'] / c['tps']:.0%} | "
                f"{s['ttft_p50']:.1f} / {c['ttft_p50']:.1f} / {e['ttft_p50']:.1f} | "
                f"{s['first_event_p50']:.1f} ({s['late_text']}) | "
                f"{s['ttft_p99']:.1f} / {c['ttft_p99']:.1f} | "
                f"{s['itl_p50']:.2f} / {c['request_itl_p50']:.2f} | "
                f"{s['chunk_gap_p50']:.2f} / {e['step_p50']:.2f} | "
                f"{s['errors']} |")
    return "\n".join(rows)


def run_lines(engine: dict, stack: dict) -> str:
    """Where a point ran more than once: each run's TTFT p50 and ITL p50 against the engine's
    closed loop."""
    lines = []
    for key, fig in stack.items():
        runs = fig.get("runs", []) if isinstance(fig, dict) else []
        closed = engine.get(key, {}).get("closed")
        if len(runs) < 2 or not closed:
            continue
        for run in runs:
            lines.append(f"{key} run {run['run']} {run['connections']:>5}: TTFT p50 "
                         f"{run['ttft_p50']:.1f} ms = {run['ttft_p50'] / closed['ttft_p50']:.2f}x"
                         f", p99 {run['ttft_p99']:.1f}; ITL p50 {run['itl_p50']:.2f} ms = "
                         f"{run['itl_p50'] / closed['request_itl_p50']:.2f}x; "
                         f"{run['tps']:,.0f} tok/s = {run['tps'] / closed['tps']:.0%}")
    return "\n\n" + "\n".join(lines) if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, one point")
    parser.add_argument("--out", default=os.environ.get("OUT", "serve_gpu_out"),
                        help="folder for serve_gpu.json and the stack's log (default: $OUT)")
    parser.add_argument("--only", help="ISL/OSL points to run, e.g. 200/200 (default: all)")
    parser.add_argument("--concurrency", type=int, nargs="*",
                        help="only these concurrencies (default: the grid's)")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="skip served points that would start past this many seconds")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no requests at each point's shape before it (what a worker that "
                        "captures its CUDA graphs at start must not need)")
    parser.add_argument("--py-spy", action="store_true",
                        help="profile the decode worker and the frontend at each served point "
                        "(py-spy on PATH; raw stacks into --out)")
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "ARGS"),
                        help="serve the grid once per variant: a name and `tandem up` flags "
                        "added to the defaults, after a leading space, led by any NAME=VALUE "
                        "for its environment (repeatable; default: one, no flags)")
    parser.add_argument("--engine-after", action="store_true",
                        help="run the engine alone again after the stack, at one stream: its "
                        "TTFT there varies between calls more than the stack's does")
    parser.add_argument("--rounds", type=int, default=0,
                        help="then this many more rounds at one stream with the stack still "
                        "up: the engine alone, the stack, alternating (ratios per round)")
    parser.add_argument("--trace", action="store_true",
                        help="the stack prints its spans (OpenTelemetry's console exporter; "
                        "carry opentelemetry-sdk) and each request's TTFT is split by hop")
    parser.add_argument("--connections", nargs="+", choices=("fresh", "kept"),
                        default=["fresh"],
                        help="the load generator's connections, one run of each point per mode "
                        "in turn: fresh (opened as the requests go out, inside their TTFT) or "
                        "kept (opened before the point, as a client that served holds them)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="serve each point this many times in a row per connection mode "
                        "(the table shows the first run; every run is printed)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="the load generator's processes, the streams split between them "
                        "(one Python process spreads a burst over tens of ms by itself)")
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"),
                        help="the engine's --quantization, alone and under tandem up (fp8: "
                             "the dummy weights' projections in FP8 rows)")
    parser.add_argument("--speculative-config", default="",
                        help="the engine's --speculative-config, alone and under tandem up")
    parser.add_argument("--max-num-tokens", type=int, default=EngineArgs.max_num_tokens,
                        help="the engine's token budget per step, alone and in the stack "
                        "(default: the engine's)")
    parser.add_argument("--http-port", type=int, default=18000)
    parser.add_argument("--start-timeout-s", type=float, default=240)
    parser.add_argument("--phase-offline", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    began = time.monotonic()
    args.device, args.dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    grid = dict(SMOKE_GRID if args.smoke else GRID)
    if args.only:
        grid = {k: v for k, v in grid.items() if f"{k[0]}/{k[1]}" in args.only.split(",")}
    if args.concurrency:
        grid = {k: [p for p in v if p[0] in args.concurrency] for k, v in grid.items()}
    if args.phase_offline:
        figures = asyncio.run(offline(pathlib.Path(args.model), args.device, args.dtype, grid,
                                      not args.no_warmup, args.max_num_tokens,
                                      args.quantization, args.speculative_config))
        pathlib.Path(args.phase_offline).write_text(json.dumps(figures))
        return
    shape = SMALL if args.smoke else LLAMA_8B
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(tempfile.mkdtemp(prefix="serve-gpu-"))
    model = write_model(root, shape)
    device_name = "cpu"
    if not args.smoke:
        import torch
        device_name = torch.cuda.get_device_name()
    print(f"device {device_name}; model {model} (vocab {DEMO_VOCAB}); grid {grid}", flush=True)
    engine = offline_in_subprocess(model, args)
    t_engine = time.monotonic() - began
    max_batch = max(c for points in grid.values() for c, _ in points)
    max_seq = max(2048, max(isl + osl for isl, osl in grid) + 64)
    result: dict = {"device": device_name, "shape": {**shape, "vocab_size": DEMO_VOCAB},
                    "grid": {f"{i}/{o}": p for (i, o), p in grid.items()}, "engine": engine,
                    "served": {}, "seconds": {"engine": t_engine}}
    tables = []
    for name, extra in args.variant or [("default", "")]:
        log = out_dir / f"tandem_up-{name}.log"
        start = time.monotonic()
        proc, url = start_stack(model, args, kv_blocks(grid), max_batch, max_seq, log,
                                shlex.split(extra))
        print(f"READY after {time.monotonic() - start:.1f} s ({name}): {url}", flush=True)
        try:
            profiles = Profiles(out_dir, proc.pid) if args.py_spy else None
            stack = asyncio.run(served(url, grid, began + args.budget_s, not args.no_warmup,
                                       profiles, tuple(args.connections), args.repeat,
                                       args.client_processes))
            if args.rounds:
                result.setdefault("rounds", {})[name] = alternate(url, model, args, grid)
        finally:
            stop_stack(proc)
        result["served"][name] = stack
        if args.trace:
            print_ttft_split(log, grid, stack)
        result["seconds"][f"stack_start {name}"] = time.monotonic() - start
        tables.append((name, extra, table(grid, engine, stack) + run_lines(engine, stack)))
    if args.engine_after and any(c == 1 for points in grid.values() for c, _ in points):
        result["engine_after"] = after = offline_in_subprocess(model, args, [1])
        for key, fig in after.items():
            print(f"engine after the stack, {key}: TTFT p50 closed loop "
                  f"{fig['closed']['ttft_p50']:.1f} ms (before: "
                  f"{engine[key]['closed']['ttft_p50']:.1f} ms)", flush=True)
    result["seconds"]["total"] = time.monotonic() - began
    result["tables"] = {name: text for name, _, text in tables}
    (out_dir / "serve_gpu.json").write_text(json.dumps(result, indent=1))
    for name, extra, text in tables:
        print(f"\n{device_name}, {'small' if args.smoke else 'Llama-3.1-8B'} shape (vocab "
              f"{DEMO_VOCAB}), dummy {args.dtype} weights, {args.max_num_tokens} tokens per step, one "
              f"decode worker; stack "
              f"{name!r} (tandem up {extra or 'defaults'}); efficiency = served output tok/s "
              f"/ the engine's\n")
        print(text)
    print(f"\nseconds: {json.dumps({k: round(v, 1) for k, v in result['seconds'].items()})}")

if __name__ == "__main__":
    main()
