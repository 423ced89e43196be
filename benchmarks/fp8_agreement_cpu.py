"""How often FP8 changes what a trained model writes (a script, not a test): issue 42's "greedy
agreement" for the FP8 KV cache, and for FP8 weights, on the demo model.

Dummy weights on the GPU decide nothing about agreement, so this runs the one trained model
Tandem has: the demo (float32 on the CPU), greedy, on the prompt sets of
`python -m tandem.model.draft_eval` (held-out corpus prompts, chat messages the corpus does not
hold). Each variant against the plain float32 engine: an FP8 e4m3 KV cache (scale 1.0); the
demo written as a compressed-tensors FP8 checkpoint with per-row scales
(`quantize.write_fp8_checkpoint`, as `--quantization fp8` quantizes on a GPU), which the CPU
dequantizes (the weights' rounding only: the GPU's W8A8 GEMMs also round each token's
activations to FP8, which the CPU does not); both. Printed: the share of answers identical token
for token, and the mean share of each answer's tokens before its first difference.

    .venv/bin/python benchmarks/fp8_agreement_cpu.py [--max-tokens 64] [--prompts N]
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import tempfile
import time

from tokenizers import Tokenizer

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model import demo, draft_eval
from tandem.model.quantize import write_fp8_checkpoint

#: name: (FP8 checkpoint, KV cache dtype)
VARIANTS = {"fp8 KV cache": (False, "fp8"), "fp8 weights (rows)": (True, "auto"),
            "fp8 weights + fp8 KV": (True, "fp8")}


async def answers(args: EngineArgs, prompts: list[list[int]], max_tokens: int
                  ) -> list[list[int]]:
    engine = create_reference_engine(args)
    await engine.start()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def one(i: int, prompt: list[int]) -> list[int]:
        out: list[int] = []
        async for chunk in engine.add_request(EngineRequest(
                f"a{i}-{time.monotonic_ns()}", tuple(prompt), params)):
            out.extend(chunk.token_ids)
        return out

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.close()


def agreement(base: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of answers equal, mean share of each answer before its first difference)."""
    same, prefix = 0, 0.0
    for a, b in zip(base, other, strict=True):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n / max(len(a), 1)
    return same / len(base), prefix / len(base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per set (all)")
    opts = parser.parse_args()
    model = demo.ensure_demo_model()
    with tempfile.TemporaryDirectory() as tmp:
        fp8_model = write_fp8_checkpoint(model, pathlib.Path(tmp) / "demo-fp8", "ct-channel")
        report(model, fp8_model, opts.prompts, opts.max_tokens)


def report(model: pathlib.Path, fp8_model: pathlib.Path, limit: int | None,
           max_tokens: int) -> None:
    sets = draft_eval.eval_prompts(Tokenizer.from_file(str(model / "tokenizer.json")))
    print("| prompts | n | variant | answers identical | tokens before the first difference |")
    print("|---|---:|---|---:|---:|")
    for name, prompts in sets.items():
        prompts = prompts[:limit]
        base_args = EngineArgs(model=str(model), device="cpu")
        base = asyncio.run(answers(base_args, prompts, max_tokens))
        for variant, (fp8_weights, kv_dtype) in VARIANTS.items():
            args = EngineArgs(model=str(fp8_model if fp8_weights else model), device="cpu",
                              kv_cache_dtype=kv_dtype)
            other = asyncio.run(answers(args, prompts, max_tokens))
            same, prefix = agreement(base, other)
            print(f"| {name} | {len(prompts)} | {variant} | {same:.0%} | {prefix:.1%} |",
                  flush=True)


if __name__ == "__main__":
    main()
