"""The host KV tier (issue 16): multi-turn conversations whose KV outgrows the device pool,
with the tier off and on.

Default mode (no GPU): `tandem up --engine mock` with the mocker's timing model (speedup 1,
real time) and a Llama-3-8B-shaped KV layout (32 layers, 8 KV heads of 128, bfloat16: 4 MiB
per 32-token block), so copies cost what they would over a 25 GB/s host link
(`--mock-kv-host-gbps`). The config is written into a temporary model directory next to the
demo model's tokenizer; the mock reads no weights. USERS conversations run at once, each a
loop of TURNS turns with a think time between them (uniform in 0.5-1.5x THINK_S; each user
starts after a random share of it, so that turns do not arrive in lockstep): prompt = the
whole history (previous prompts and the answers' token ids as the engine returned them) +
USER_TOKENS new random tokens, answer = OUTPUT_TOKENS tokens (ignore_eos). The think time
keeps the running requests' KV within the device pool (a dozen or so users are active at a
time), so what the tier changes is whether a returning user's history is still cached, not
how many requests fit; with no think time both runs queue for device blocks alike. Requests go through the public gRPC API
(`tandem.v1.Inference/Generate`, token input) so that the answer's token ids come back.
Total KV at the end is USERS x TURNS x (USER_TOKENS + OUTPUT_TOKENS) tokens; the defaults make
it 4x the device pool (64 x 8 x 1,100 = 563k tokens = 17,600 blocks vs 4,400). The host tier
(--host-gib) holds all of it; the tier-on run is repeated per --gbps (25: PCIe 4 x16 from
pinned memory; 50: PCIe 5).

Measured per run: TTFT (request sent -> first chunk with tokens) p50/p99 over turns 2..TURNS
(turn 1 has nothing cached in either run), throughput (output tokens / wall time), the share
of prompt tokens served from cache (usage.cached_tokens), and the worker's copy counters
(Worker.Stats). Target (issue 16): TTFT p50 with the tier <= 0.5x without it.

`--gpu`: the reference engine's offload/onboard bandwidth on a CUDA device against the
measured pinned host<->device copy bandwidth (target: both >= 0.7x, issue 25). It builds a
reference engine on a dummy-weight model with a small device pool and a host tier, evicts a set of
prompts to the host tier, brings them back, and reads the engine's copy counters (CUDA-event
timed; each copy's rate is printed too); the pinned baseline is one large pinned tensor
copied each way.

Usage (from the repository root):
    .venv/bin/python benchmarks/host_kv_tier.py                    # mock, tier off vs on
    .venv/bin/python benchmarks/host_kv_tier.py --users 16 --turns 4   # a quick look
    .venv/bin/python benchmarks/host_kv_tier.py --gpu              # on a CUDA host
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import pct  # noqa: E402

if TYPE_CHECKING:
    from tests.e2e.topology import Topology

BLOCK = 32
#: Llama-3-8B's KV shape (what the mock's copy time is computed from).
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "max_position_embeddings": 16384, "torch_dtype": "bfloat16"}


#: The same KV per token on a narrow model (GPU mode: dummy weights of 0.5 GB, not 16 GB; the
#: copies depend only on the blocks' bytes).
KV_LIKE_8B = {**LLAMA3_8B, "hidden_size": 1024, "intermediate_size": 2048,
              "num_attention_heads": 8}


def model_dir(workdir: pathlib.Path, shape: dict[str, object] = LLAMA3_8B) -> pathlib.Path:
    """The demo model's tokenizer with a config of `shape` and no weights (the mock reads none;
    the reference engine draws them with --load-format dummy)."""
    from tandem.model.demo import ensure_demo_model

    demo = ensure_demo_model()
    out = workdir / "kv-llama3-8b"
    out.mkdir()
    for item in demo.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, out / item.name)
    config = json.loads((demo / "config.json").read_text())
    config.update(shape)
    (out / "config.json").write_text(json.dumps(config))
    return out


def start(model: pathlib.Path, extra: list[str]) -> Topology:
    """`tandem up` on the mock engine with `model`, ready (tests/e2e/topology.py)."""
    from tests.e2e.topology import start_topology  # gRPC's health stubs: only the mock mode
    return start_topology("--engine", "mock", "--model", str(model), "--kv-block-size",
                          str(BLOCK), "--max-seq-len", "16384", "--log-level", "warning", *extra)


@dataclass
class Turn:
    user: int
    turn: int
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass
class Run:
    mode: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    worker: dict[str, float] = field(default_factory=dict)


async def conversation(stub: object, model: str, user: int, args: argparse.Namespace,
                       out: list[Turn]) -> None:
    from tandem.v1 import common_pb2, inference_pb2

    rng = random.Random(args.seed * 1000 + user)
    history: list[int] = []
    await asyncio.sleep(rng.uniform(0, args.think_s))
    for turn in range(args.turns):
        if turn:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think_s)
        prompt = history + [rng.randrange(10, 4000) for _ in range(args.user_tokens)]
        request = inference_pb2.InferenceRequest(
            model=model, tokens=inference_pb2.TokenInput(token_ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=args.output_tokens, temperature=0.0,
                                               ignore_eos=True))
        record = Turn(user, turn, len(prompt))
        answer: list[int] = []
        sent = time.perf_counter()
        try:
            async for chunk in stub.Generate(request):  # type: ignore[attr-defined]
                if chunk.token_ids and not answer:
                    record.ttft_s = time.perf_counter() - sent
                answer.extend(chunk.token_ids)
                if chunk.HasField("usage"):
                    record.cached_tokens = chunk.usage.cached_tokens
        except Exception as exc:  # reported in the table
            record.error = str(exc)[:200]
            out.append(record)
            return
        record.output_tokens = len(answer)
        out.append(record)
        history = prompt + answer


async def run_load(address: str, model: str, args: argparse.Namespace) -> tuple[list[Turn],
                                                                                 float]:
    import grpc

    from tandem.v1 import inference_pb2_grpc

    turns: list[Turn] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        started = time.perf_counter()
        await asyncio.gather(*(conversation(stub, model, u, args, turns)
                               for u in range(args.users)))
        return turns, time.perf_counter() - started


def worker_counters(address: str) -> dict[str, float]:
    import grpc

    from tandem.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        s = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
    return {"offload_blocks": s.kv_offload_blocks, "onboard_blocks": s.kv_onboard_blocks,
            "host_hit_rate": s.kv_host_hit_rate, "host_blocks_used": s.kv_host_blocks_used}


def mock_main(args: argparse.Namespace) -> None:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-host-tier-"))
    model = model_dir(workdir)
    block_bytes = 2 * 32 * BLOCK * 8 * 128 * 2
    total_blocks = args.users * args.turns * (args.user_tokens + args.output_tokens) // BLOCK
    common = ["--speedup-ratio", str(args.speedup), "--num-gpu-blocks-override",
              str(args.device_blocks)]
    modes = {"off": common}
    for gbps in args.gbps:
        modes[f"on@{gbps:g}"] = [*common, "--kv-host-cache-bytes",
                                 str(int(args.host_gib * (1 << 30))), "--mock-kv-host-gbps",
                                 str(gbps)]
    runs = []
    for mode, extra in modes.items():
        topo = start(model, extra)
        try:
            turns, wall = asyncio.run(run_load(topo.grpc_address, model.name, args))
            runs.append(Run(mode, turns, wall, worker_counters(topo.decode_addresses[0])))
        finally:
            topo.stop()
    print(f"mock engine, speedup {args.speedup}, Llama-3-8B KV layout ({block_bytes >> 20} MiB "
          f"per {BLOCK}-token block); {args.users} users x {args.turns} turns x "
          f"({args.user_tokens} new + {args.output_tokens} output) tokens = {total_blocks} "
          f"blocks of KV vs a device pool of {args.device_blocks} "
          f"({total_blocks / args.device_blocks:.1f}x); think time {args.think_s} s; host tier "
          f"{args.host_gib} GiB (on@G: simulated host link of G GB/s)")
    print(f"{'tier':8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'all-turn p50':>13} "
          f"{'out tok/s':>10} {'cached %':>9} {'offload blk':>12} {'onboard blk':>12} "
          f"{'errors':>7}")
    p50s = {}
    for run in runs:
        ok = [t for t in run.turns if not t.error]
        later = [t.ttft_s for t in ok if t.turn > 0]
        out_tokens = sum(t.output_tokens for t in ok)
        cached = sum(t.cached_tokens for t in ok) / max(sum(t.prompt_tokens for t in ok), 1)
        p50s[run.mode] = statistics.median(later)
        print(f"{run.mode:8} {p50s[run.mode] * 1000:>12.0f} {pct(later, 99) * 1000:>12.0f} "
              f"{statistics.median(t.ttft_s for t in ok) * 1000:>13.0f} "
              f"{out_tokens / run.wall_s:>10.0f} {cached * 100:>9.1f} "
              f"{run.worker['offload_blocks']:>12.0f} {run.worker['onboard_blocks']:>12.0f} "
              f"{len(run.turns) - len(ok):>7}")
    for mode in p50s:
        if mode != "off":
            print(f"TTFT p50 (turns 2..{args.turns}) {mode} / off: "
                  f"{p50s[mode] / p50s['off']:.2f}x (target <= 0.5x)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            [{"mode": r.mode, "wall_s": r.wall_s, "worker": r.worker,
              "turns": [t.__dict__ for t in r.turns]} for r in runs]))


# ---- --gpu: the reference engine's copy bandwidth on CUDA -------------------------------------


def pinned_gbps(nbytes: int) -> tuple[float, float]:
    """(host -> device, device -> host) GB/s of one pinned tensor of `nbytes`."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    results = []
    for src, dst in ((host, device), (device, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        results.append(5 * nbytes / (start.elapsed_time(end) / 1000) / 1e9)
    return results[0], results[1]


async def gpu_engine_copies(args: argparse.Namespace) -> dict[str, float]:
    from tandem.engines.args import EngineArgs
    from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
    from tandem.engines.types import EngineRequest, SamplingParams

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-host-tier-gpu-"))
    model = model_dir(workdir, KV_LIKE_8B)
    engine = create_reference_engine(EngineArgs(
        model=str(model), device=args.gpu_device, dtype="bfloat16", load_format="dummy",
        kv_block_size=BLOCK, num_gpu_blocks=args.gpu_device_blocks,
        kv_host_cache_bytes=int(args.gpu_host_gib * (1 << 30)), max_seq_len=16384,
        enforce_eager=True))
    assert isinstance(engine, ReferenceEngine)
    await engine.start()
    assert engine.host_kv is not None
    steps: list[tuple[str, int, float]] = []  # every copy's (kind, blocks, seconds)
    finished = engine.host_kv.finished

    def logged() -> list[tuple[str, int, float]]:
        done = finished()
        steps.extend(done)
        return done

    engine.host_kv.finished = logged  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.gpu_prompt_tokens)]
               for _ in range(args.gpu_prompts)]

    async def run(tag: str) -> None:
        for i, prompt in enumerate(prompts):
            async for _ in engine.add_request(EngineRequest(f"{tag}{i}", tuple(prompt),
                                                            greedy)):
                pass

    await run("fill")  # each prompt evicts the previous ones to the host tier
    await run("back")  # each prompt comes back from the host tier (and evicts another)
    await engine.close()
    stats = engine.stats()
    block_bytes = engine.layout.block_bytes
    for kind in ("onboard", "offload"):
        rates = [n * block_bytes / t / 1e9 for k, n, t in steps if k == kind]
        print(f"{kind} GB/s per copy: {' '.join(f'{r:.1f}' for r in rates)}")
    return {"offload_gbps": stats.kv_offload_bytes / stats.kv_offload_seconds / 1e9,
            "onboard_gbps": stats.kv_onboard_bytes / stats.kv_onboard_seconds / 1e9,
            "offload_blocks": stats.kv_offload_blocks, "onboard_blocks": stats.kv_onboard_blocks,
            "block_bytes": block_bytes}


def gpu_main(args: argparse.Namespace) -> None:
    import torch

    copies = asyncio.run(gpu_engine_copies(args))
    if not args.gpu_device.startswith("cuda"):  # a smoke run of the engine path
        print({k: round(v, 3) for k, v in copies.items()})
        return
    h2d, d2h = pinned_gbps(int(copies["block_bytes"]) * 256)
    print(f"device: {torch.cuda.get_device_name()}; block {int(copies['block_bytes']) >> 20} "
          f"MiB; {copies['offload_blocks']:.0f} blocks offloaded, {copies['onboard_blocks']:.0f} "
          "onboarded")
    print(f"{'direction':18} {'engine GB/s':>12} {'pinned GB/s':>12} {'ratio':>6}")
    print(f"{'onboard (H2D)':18} {copies['onboard_gbps']:>12.1f} {h2d:>12.1f} "
          f"{copies['onboard_gbps'] / h2d:>6.2f}")
    print(f"{'offload (D2H)':18} {copies['offload_gbps']:>12.1f} {d2h:>12.1f} "
          f"{copies['offload_gbps'] / d2h:>6.2f}")
    print("target: onboard and offload >= 0.7x pinned")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--think-s", type=float, default=10.0,
                        help="mean pause between a user's turns, seconds")
    parser.add_argument("--device-blocks", type=int, default=4400)
    parser.add_argument("--host-gib", type=float, default=80.0)
    parser.add_argument("--gbps", type=float, nargs="+", default=[25.0, 50.0],
                        help="host link bandwidths of the tier-on runs, GB/s (one run each)")
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="write every turn's figures here")
    parser.add_argument("--gpu", action="store_true",
                        help="measure the reference engine's copy bandwidth on CUDA instead")
    parser.add_argument("--gpu-device-blocks", type=int, default=64)
    parser.add_argument("--gpu-host-gib", type=float, default=2.0)
    parser.add_argument("--gpu-device", default="cuda",
                        help="cpu: a smoke run of the engine path (no pinned baseline)")
    parser.add_argument("--gpu-prompts", type=int, default=8)
    parser.add_argument("--gpu-prompt-tokens", type=int, default=1024)
    args = parser.parse_args()
    if args.gpu:
        gpu_main(args)
    else:
        mock_main(args)


if __name__ == "__main__":
    main()
