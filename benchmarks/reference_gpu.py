"""Reference engine on a GPU (a script, not a test): prints a table.

1. Greedy tokens equal transformers' on CUDA for tiny test models (llama, qwen3), float32.
2. A dummy-weight Llama-3.1-8B shape in bf16: decode inter-token latency at batch 1 and output
   tokens/s at batch 64, next to transformers' own batch-1 step time (dynamic cache) in the
   same run, and the weight-read floor (weight bytes / measured copy bandwidth).

    PYTHONPATH=. python3 benchmarks/reference_gpu.py            # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/reference_gpu.py --small    # CPU smoke run of the script
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
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
             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048,
             rope_theta=10000.0, rms_norm_eps=1e-5)


def write_config(path: pathlib.Path, shape: dict) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype":
              "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 1, **shape}
    (path / "config.json").write_text(json.dumps(config))
    return path


async def generate(engine, prompts: list[list[int]], max_tokens: int, greedy: bool = True):
    """Submits all prompts at once; returns per request (tokens, arrival times)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0,
                            ignore_eos=True, seed=None if greedy else 1)
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


async def check_equivalence(device: str, root: pathlib.Path) -> list[str]:
    rows = []
    for family in ("llama", "qwen3"):
        model_dir = write_tiny_model(root / family, family, seed=3)
        engine = create_reference_engine(EngineArgs(model=str(model_dir), device=device,
                                                    dtype="float32", num_gpu_blocks=512,
                                                    kv_block_size=16))
        await engine.start()
        prompts = [[(i * 37 + j * 11) % (engine.vocab_size - 10) + 5 for j in range(n)]
                   for i, n in enumerate((5, 23, 41, 12))]
        results = await generate(engine, prompts, 16)
        await engine.close()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=torch.float32).to(device).eval()
        same = 0
        for prompt, (tokens, _) in zip(prompts, results):
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=16, min_new_tokens=16, eos_token_id=None)
            same += out[0, len(prompt):].tolist() == tokens
        rows.append(f"| greedy = transformers ({family}, {device}, fp32) | {same}/4 prompts |")
        del hf
    return rows


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - start)


def itl_ms(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    return 1000 * statistics.median(gaps) if gaps else float("nan")


async def decode_figures(device: str, root: pathlib.Path, shape: dict, steps: int, batch: int,
                         eager: bool) -> tuple[list[str], float]:
    model_dir = write_config(root / "llama8b", shape)
    engine = create_reference_engine(EngineArgs(
        model=str(model_dir), device=device, dtype="bfloat16", load_format="dummy",
        num_gpu_blocks=(batch * (128 + steps)) // 32 + 64, kv_block_size=32,
        max_batch_size=batch, max_num_tokens=8192, enforce_eager=eager))
    mode = "eager" if eager or device == "cpu" else "CUDA graphs"
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    await engine.start()
    prompt = [[(7 * i + j) % 1000 + 5 for j in range(128)] for i in range(batch)]
    await generate(engine, prompt[:1], 8)  # warm-up
    (tokens, times), = await generate(engine, prompt[:1], steps)
    b1 = itl_ms(times[1:])
    start = time.perf_counter()
    results = await generate(engine, prompt, steps)
    wall = time.perf_counter() - start
    total = sum(len(t) for t, _ in results)
    b64_itl = statistics.median(itl_ms(t[1:]) for _, t in results)
    await engine.close()
    del engine
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    rows = [f"| engine ({mode}) decode ITL p50, batch 1 | {b1:.2f} ms |",
            f"| engine ({mode}) decode ITL p50, batch {batch} | {b64_itl:.2f} ms |",
            f"| engine ({mode}) output tokens/s, batch {batch} (prefill included) | "
            f"{total / wall:,.0f} |"]
    return rows, weight_bytes


def hf_step_ms(device: str, root: pathlib.Path, shape: dict, steps: int) -> float:
    """transformers' greedy generate (dynamic cache), batch 1: ms per generated token."""
    config = transformers.AutoConfig.from_pretrained(root / "llama8b")
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.tensor([[(j % 1000) + 5 for j in range(128)]], device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None)
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)
    timings = []
    for n in (8, 8 + steps):
        torch.cuda.synchronize() if device.startswith("cuda") else None
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize() if device.startswith("cuda") else None
        timings.append(time.perf_counter() - start)
    del model
    return 1000 * (timings[1] - timings[0]) / steps


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="CPU smoke run with a small shape")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    shape = SMALL if args.small else LLAMA_8B
    steps = 16 if args.small else args.steps
    batch = 4 if args.small else args.batch
    rows = [f"| device | {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} |"]
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        rows += await check_equivalence(device, root)
        for eager in (True, False):
            decode_rows, weight_bytes = await decode_figures(device, root, shape, steps, batch,
                                                             eager)
            rows += decode_rows
        rows.append(f"| weights (dummy, bf16) | {weight_bytes / 1e9:.2f} GB |")
        hf = hf_step_ms(device, root, shape, steps)
        rows.append(f"| transformers generate ms/token, batch 1 (dynamic cache) | {hf:.2f} ms |")
        if device == "cuda":
            bw = copy_bandwidth(device)
            rows.append(f"| copy bandwidth (read + write) | {bw / 1e12:.2f} TB/s |")
            rows.append(f"| weight-read floor per step | {1000 * weight_bytes / bw:.2f} ms |")
    print("| measurement | value |\n|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    asyncio.run(main())
