"""Reference engine on a GPU (a script, not a test): prints the table of issue 15's goals.

1. Greedy tokens equal transformers' on CUDA for tiny test models: float32 (llama, qwen3) and
   bfloat16 (llama, through the Triton kernels).
2. A dummy-weight Llama-3.1-8B shape in bf16 through the engine API (CUDA graphs): decode step
   time at batch 1, 8, 32, 64, 128 with ~1,024-token contexts, next to the floor of the bytes a
   step must read (weights + every sequence's KV) over the measured copy bandwidth; batch 1
   with short contexts and eager too.
3. Prefill: 8 prompts of 2,048 tokens in one step; TFLOP/s against a measured large bf16 matmul
   and the H100's dense peak, next to transformers (SDPA) on the same batch.
4. Throughput: 128 requests of 1,000 prompt and 1,000 output tokens submitted at once, output
   tokens/s, next to transformers' generate on the same batch.

    PYTHONPATH=. python3 benchmarks/reference_gpu.py            # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/reference_gpu.py --small    # CPU smoke run of the script
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model.tiny import write_tiny_model

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096,
             rope_theta=10000.0, rms_norm_eps=1e-5)
#: NVIDIA's dense bf16 figure for the H100 SXM (no sparsity).
H100_DENSE_BF16 = 989e12
BLOCK = 32


def write_config(path: pathlib.Path, shape: dict) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype":
              "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 1, **shape}
    (path / "config.json").write_text(json.dumps(config))
    return path


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def generate(engine, prompts: list[list[int]], max_tokens: int):
    """Submits all prompts at once (greedy, no EOS stop); per request (tokens, arrival times)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request(EngineRequest(f"b{i}-{time.monotonic_ns()}", tuple(p), params))
               for i, p in enumerate(prompts)]

    async def collect(stream):
        tokens, times = [], []
        async for chunk in stream:
            now = time.perf_counter()
            tokens.extend(chunk.token_ids)
            times.extend([now] * len(chunk.token_ids))
        return tokens, times

    return await asyncio.gather(*(collect(s) for s in streams))


def prompts_of(batch: int, length: int, vocab: int, salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * j + 101 * salt) % (vocab - 10) + 5 for j in range(length)]
            for i in range(batch)]


async def check_equivalence(device: str, root: pathlib.Path) -> list[str]:
    rows = []
    for family, dtype in (("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")):
        model_dir = write_tiny_model(root / f"{family}-{dtype}", family, seed=3)
        engine = create_reference_engine(EngineArgs(model=str(model_dir), device=device,
                                                    dtype=dtype, num_gpu_blocks=512,
                                                    kv_block_size=16))
        await engine.start()
        prompts = [[(i * 37 + j * 11) % (engine.vocab_size - 10) + 5 for j in range(n)]
                   for i, n in enumerate((5, 23, 41, 12))]
        results = await generate(engine, prompts, 16)
        await engine.close()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        same, first_diff = 0, []
        for prompt, (tokens, _) in zip(prompts, results):
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=16, min_new_tokens=16, eos_token_id=None)
            theirs = out[0, len(prompt):].tolist()
            same += theirs == tokens
            if theirs != tokens:
                first_diff.append(next(i for i, (a, b) in enumerate(zip(theirs, tokens))
                                       if a != b))
        note = f" (first difference at token {first_diff})" if first_diff else ""
        rows.append(f"| greedy = transformers ({family}, {device}, {dtype}) | {same}/4{note} |")
        del hf
    return rows


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    x = torch.randn(1024**3, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - start)


def matmul_rate() -> float:
    """FLOP/s of a large bf16 matmul (8192^3), the achievable dense peak."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    sync()
    return 2 * 8192**3 * 20 / (time.perf_counter() - start)


def itl_ms(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    return 1000 * statistics.median(gaps) if gaps else float("nan")


def replay_ms(engine) -> float:
    """GPU time of the batch-1 decode graph alone (no scheduling, sampling or host sync
    around it), from 50 back-to-back replays."""
    graphs = engine.graphs
    if graphs is None or not graphs.graphs:
        return float("nan")
    graph, _ = graphs.graphs[min(graphs.graphs)]
    for _ in range(5):
        graph.replay()
    sync()
    start = time.perf_counter()
    for _ in range(50):
        graph.replay()
    sync()
    return 1000 * (time.perf_counter() - start) / 50


def kv_bytes_per_token(shape: dict) -> int:
    head = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head * 2


def prefill_flops(shape: dict, params: int, batch: int, length: int) -> float:
    """Matmul FLOPs of a prefill (every weight but the embedding and LM head, once per token;
    the LM head for the last token only) plus causal attention (QK and PV over half the
    square)."""
    hidden, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    dense = params - 2 * vocab * hidden
    attention = 2 * 2 * layers * hidden * length * length / 2
    return batch * (2 * dense * length + attention + 2 * vocab * hidden)


def sizes(small: bool) -> dict:
    """The workload of each measurement (small: a CPU smoke run)."""
    return dict(batches=[1, 2, 4] if small else [1, 8, 32, 64, 128],
                ctx_prompt=96 if small else 992, new=8 if small else 32,
                isl=64 if small else 1000, osl=32 if small else 1000, conc=8 if small else 128,
                plen=256 if small else 2048, pnum=2 if small else 8)


async def engine_figures(device: str, root: pathlib.Path, shape: dict, small: bool,
                         eager: bool) -> dict:
    """Batch-1 ITL; with CUDA graphs also the decode table, the prefill batch and the
    throughput run."""
    model_dir = write_config(root / "llama8b", shape)
    vocab = shape["vocab_size"]
    z = sizes(small)
    batches, ctx, new = z["batches"], z["ctx_prompt"], z["new"]
    isl, osl, conc, plen, pnum = z["isl"], z["osl"], z["conc"], z["plen"], z["pnum"]
    blocks = (256 if eager else
              max(conc * (isl + osl), max(batches) * (ctx + new)) // BLOCK + 256)
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device=device, dtype="bfloat16", load_format="dummy",
        num_gpu_blocks=blocks, kv_block_size=BLOCK, max_batch_size=max(batches),
        max_num_tokens=max(8192, pnum * plen), enforce_eager=eager,
        enable_prefix_caching=False))
    mode = "eager" if eager or device == "cpu" else "CUDA graphs"
    figures: dict = {
        "weights": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        "params": sum(p.numel() for p in engine.model.parameters()),
        "ctx": ctx + new // 2, **z}
    await engine.start()
    await generate(engine, prompts_of(1, 128, vocab), 8)  # warm-up
    (_, times), = await generate(engine, prompts_of(1, 128, vocab, 1), 64)
    figures["row"] = (f"| engine ({mode}): decode ITL p50, batch 1, context ~160 | "
                      f"{itl_ms(times[2:]):.2f} ms |")
    figures["b1_short"] = itl_ms(times[2:])
    print(figures["row"], flush=True)
    if eager:
        await engine.close()
        return figures
    figures["replay"] = replay_ms(engine)
    print(f"graph replay alone, batch 1: {figures['replay']:.2f} ms", flush=True)
    for batch in batches:
        await generate(engine, prompts_of(batch, ctx, vocab, 2), 4)  # capture this shape
        results = await generate(engine, prompts_of(batch, ctx, vocab, 3), new)
        step = statistics.median(itl_ms(t[2:]) for _, t in results)
        figures[f"step_{batch}"] = step
        print(f"batch {batch}: {step:.2f} ms/step", flush=True)
    for reps in range(2):  # one warm-up, then timed: all prompts in one step
        sync()
        start = time.perf_counter()
        await generate(engine, prompts_of(pnum, plen, vocab, 10 + reps), 1)
        sync()
        figures["prefill_s"] = time.perf_counter() - start
    print(f"prefill: {figures['prefill_s']:.3f} s", flush=True)
    await generate(engine, prompts_of(conc, 16, vocab, 20), 4)
    start = time.perf_counter()
    results = await generate(engine, prompts_of(conc, isl, vocab, 21), osl)
    figures["engine_tps"] = sum(len(t) for t, _ in results) / (time.perf_counter() - start)
    print(f"throughput: {figures['engine_tps']:.0f} tokens/s", flush=True)
    await engine.close()
    return figures


def hf_figures(device: str, root: pathlib.Path, shape: dict, fig: dict) -> dict:
    """transformers (SDPA, dynamic cache) on the same shape: batch-1 ms/token, the prefill
    batch's time, generate's output tokens/s at the throughput batch."""
    config = transformers.AutoConfig.from_pretrained(write_config(root / "llama8b", shape))
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    vocab = config.vocab_size
    out = {}
    ids = torch.tensor(prompts_of(1, 128, vocab), device=device)
    kwargs = dict(do_sample=False, eos_token_id=None)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                   min_new_tokens=8, **kwargs)
    timings = []
    for n in (8, 72):
        sync()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, **kwargs)
        sync()
        timings.append(time.perf_counter() - start)
    out["b1_ms"] = 1000 * (timings[1] - timings[0]) / 64
    print(f"transformers batch 1: {out['b1_ms']:.2f} ms/token", flush=True)
    batch = torch.tensor(prompts_of(fig["pnum"], fig["plen"], vocab, 10), device=device)
    with torch.inference_mode():
        for _ in range(2):
            sync()
            start = time.perf_counter()
            model(batch, logits_to_keep=1)
            sync()
            out["prefill_s"] = time.perf_counter() - start
    print(f"transformers prefill: {out['prefill_s']:.3f} s", flush=True)
    ids = torch.tensor(prompts_of(fig["conc"], fig["isl"], vocab, 21), device=device)
    sync()
    start = time.perf_counter()
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=fig["osl"],
                         min_new_tokens=fig["osl"], **kwargs)
    sync()
    out["tps"] = (gen.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)
    del model
    return out


PHASES = ("equivalence", "graphs", "eager", "transformers")


async def run_phase(phase: str, device: str, root: pathlib.Path, shape: dict,
                    small: bool) -> dict:
    if phase == "equivalence":
        return {"rows": await check_equivalence(device, root)}
    if phase in ("graphs", "eager"):
        return await engine_figures(device, root, shape, small, eager=phase == "eager")
    return hf_figures(device, root, shape, sizes(small))


def phase_in_subprocess(phase: str, small: bool) -> dict:
    """Runs one phase in its own process, so that each starts with the whole GPU free."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "figures.json"
        argv = [sys.executable, __file__, "--phase", phase, "--out", str(out)]
        subprocess.run(argv + (["--small"] if small else []), check=True)
        return json.loads(out.read_text())


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="CPU smoke run with a small shape")
    parser.add_argument("--phase", choices=PHASES, help="run one phase (internal)")
    parser.add_argument("--out", help="with --phase: where its figures go (JSON)")
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    shape = SMALL if args.small else LLAMA_8B
    if args.phase:
        with tempfile.TemporaryDirectory() as tmp:
            figures = await run_phase(args.phase, device, pathlib.Path(tmp), shape, args.small)
        pathlib.Path(args.out).write_text(json.dumps(figures))
        return
    phases = {phase: phase_in_subprocess(phase, args.small) for phase in PHASES}
    fig, hf = phases["graphs"], phases["transformers"]
    rows = [f"| device | {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} |",
            *phases["equivalence"]["rows"], fig["row"], phases["eager"]["row"]]
    bw = copy_bandwidth() if device == "cuda" else float("nan")
    peak = matmul_rate() if device == "cuda" else float("nan")
    weights = fig["weights"]
    floor1 = 1000 * weights / bw
    rows += [f"| transformers generate, batch 1, context ~160 | {hf['b1_ms']:.2f} ms/token |",
             f"| weights (dummy, bf16) | {weights / 1e9:.2f} GB |",
             f"| copy bandwidth (read + write) | {bw / 1e12:.2f} TB/s |",
             f"| weight-read floor per step | {floor1:.2f} ms |",
             f"| batch-1 decode graph replay alone (GPU time of the model) | "
             f"{fig['replay']:.2f} ms |",
             f"| **goal 1: batch-1 ITL / floor** | **{fig['b1_short'] / floor1:.2f}x** "
             "(target <= 1.25x) |"]
    print("| measurement | value |\n|---|---|")
    print("\n".join(rows))
    kv = kv_bytes_per_token(shape)
    print(f"\nDecode steps, contexts ~{fig['ctx']} tokens (CUDA graphs):\n")
    print("| batch | ms/step | tokens/s | floor (weights + KV) ms | step / floor |\n"
          "|---:|---:|---:|---:|---:|")
    for b in fig["batches"]:
        step = fig[f"step_{b}"]
        floor = 1000 * (weights + b * fig["ctx"] * kv) / bw
        print(f"| {b} | {step:.2f} | {1000 * b / step:,.0f} | {floor:.2f} | {step / floor:.2f}x |")
    flops = prefill_flops(shape, fig["params"], fig["pnum"], fig["plen"])
    ours, theirs = flops / fig["prefill_s"], flops / hf["prefill_s"]
    print(f"\nPrefill, {fig['pnum']} x {fig['plen']} tokens in one step ({flops / 1e12:.0f} "
          f"TFLOP):\n\n| | seconds | TFLOP/s | of measured matmul peak ({peak / 1e12:.0f}) | "
          f"of H100 dense bf16 (989) |\n|---|---:|---:|---:|---:|")
    for name, secs, rate in (("engine", fig["prefill_s"], ours),
                             ("transformers (SDPA)", hf["prefill_s"], theirs)):
        print(f"| {name} | {secs:.3f} | {rate / 1e12:.0f} | {rate / peak:.0%} | "
              f"{rate / H100_DENSE_BF16:.0%} |")
    print(f"\nThroughput, {fig['conc']} requests, ISL/OSL {fig['isl']}/{fig['osl']}:\n\n"
          f"| | output tokens/s |\n|---|---:|\n| engine | {fig['engine_tps']:,.0f} |\n"
          f"| transformers generate (dynamic cache) | {hf['tps']:,.0f} |")


if __name__ == "__main__":
    asyncio.run(main())
