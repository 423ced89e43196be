"""CPU benchmark: output tokens/s of the reference engine vs transformers `generate`.

Both run greedy decoding of the same prompts (random token ids, no EOS stop) on the same model
and threads, batch 1 and batch 16, prompt 32 / output 64 tokens by default. The engine is driven
through its Python API (create_reference_engine, add_request, one asyncio task per stream), so no
gRPC or HTTP is measured; transformers runs `generate` with its dynamic KV cache, batches padded
on the left. Throughput is generated tokens / wall time of the whole batch (prefill included),
best of `--repeats` after one warm-up run, engine and transformers runs alternating; the ratio is
engine / transformers from the same run. The machine's load average is printed: figures taken while
other work ran are not comparable.

Models: "tiny" (the 2-layer test Llama of tandem.model.tiny) and "100m" (a Llama of ~100M
parameters: hidden 768, 12 layers, 12 heads, intermediate 2048, the demo tokenizer's vocabulary;
random weights). Both are written into a temporary directory.

    .venv/bin/python benchmarks/reference_cpu.py [--models tiny 100m] [--batches 1 16]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model.tiny import write_tiny_model

#: transformers config overrides of each benchmark model (family "llama").
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "100m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 12, "head_dim": 64, "intermediate_size": 2048,
             "max_position_embeddings": 2048},
}


@dataclasses.dataclass
class Row:
    model: str
    params_m: float
    batch: int
    engine_tps: float
    hf_tps: float

    @property
    def ratio(self) -> float:
        return self.engine_tps / self.hf_tps


def prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    # Ids past the special tokens (0..4), so no prompt holds an EOS or a pad.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, prompt_len), generator=g).tolist()


class EngineRunner:
    """One reference engine for a batch; `run` generates every prompt once, concurrently."""

    def __init__(self, model_dir: str, batch_prompts: list[list[int]], output_len: int) -> None:
        self.engine = create_reference_engine(EngineArgs(
            model=model_dir, device="cpu", max_batch_size=len(batch_prompts),
            # Room for the whole batch, and no prefix-cache hits between runs (repeated prompts
            # would otherwise be served from the cache and skip prefill).
            enable_prefix_caching=False, num_gpu_blocks=len(batch_prompts) * 8))
        self.prompts = batch_prompts
        self.sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        self.num_requests = 0

    async def run(self) -> float:
        """Seconds until the last stream of the batch finished."""
        async def consume(ids: list[int]) -> int:
            self.num_requests += 1
            stream = self.engine.add_request(EngineRequest(f"r{self.num_requests}", tuple(ids),
                                                           self.sampling))
            return sum([len(chunk.token_ids) async for chunk in stream])

        start = time.perf_counter()
        counts = await asyncio.gather(*(consume(p) for p in self.prompts))
        elapsed = time.perf_counter() - start
        assert counts == [self.sampling.max_tokens] * len(self.prompts), counts
        return elapsed


class HfRunner:
    """transformers `generate` over the same prompts as one left-padded batch."""

    def __init__(self, model: Any, batch_prompts: list[list[int]], output_len: int,
                 pad_id: int) -> None:
        # All prompts have one length here, so left padding adds no pad token; it is set up
        # anyway, as batched generation with a decoder needs it.
        width = max(len(p) for p in batch_prompts)
        self.ids = torch.full((len(batch_prompts), width), pad_id)
        self.mask = torch.zeros_like(self.ids)
        for row, p in enumerate(batch_prompts):
            self.ids[row, width - len(p):] = torch.tensor(p)
            self.mask[row, width - len(p):] = 1
        self.model, self.output_len, self.pad_id = model, output_len, pad_id

    def run(self) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            # min_new_tokens: no early stop at EOS, as ignore_eos for the engine.
            out = self.model.generate(input_ids=self.ids, attention_mask=self.mask,
                                      do_sample=False, max_new_tokens=self.output_len,
                                      min_new_tokens=self.output_len, pad_token_id=self.pad_id)
        elapsed = time.perf_counter() - start
        assert out.shape == (self.ids.shape[0], self.ids.shape[1] + self.output_len), out.shape
        return elapsed


async def best_times(engine: EngineRunner, hf: HfRunner, repeats: int) -> tuple[float, float]:
    """Fastest of `repeats` runs of each, after one warm-up run of each. The two alternate, so
    that load from elsewhere on the machine hits both alike."""
    await engine.run()
    hf.run()
    engine_s, hf_s = [], []
    for _ in range(repeats):
        engine_s.append(await engine.run())
        hf_s.append(hf.run())
    return min(engine_s), min(hf_s)


async def run_pair(model_dir: str, hf: Any, batch_prompts: list[list[int]],
                   output_len: int, pad_id: int, repeats: int) -> tuple[float, float]:
    engine = EngineRunner(model_dir, batch_prompts, output_len)
    await engine.engine.start()
    try:
        return await best_times(engine, HfRunner(hf, batch_prompts, output_len, pad_id), repeats)
    finally:
        await engine.engine.close()


def bench_model(name: str, root: pathlib.Path, batches: list[int], prompt_len: int,
                output_len: int, repeats: int) -> list[Row]:
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny_model(root / name, "llama", seed=0, **MODELS[name])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    params_m = sum(p.numel() for p in hf.parameters()) / 1e6
    vocab, pad_id = hf.config.vocab_size, hf.config.pad_token_id
    rows = []
    for batch in batches:
        batch_prompts = prompts(batch, prompt_len, vocab, seed=batch)
        tokens = batch * output_len
        engine_s, hf_s = asyncio.run(run_pair(str(model_dir), hf, batch_prompts, output_len,
                                              pad_id, repeats))
        rows.append(Row(name, params_m, batch, tokens / engine_s, tokens / hf_s))
        print(f"  {name} batch {batch}: engine {engine_s:.2f} s, transformers {hf_s:.2f} s",
              file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch "
          f"threads, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"prompt {args.prompt_len}, output {args.output_len}, greedy, best of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        for name in args.models:
            rows += bench_model(name, pathlib.Path(tmp), args.batches, args.prompt_len,
                                args.output_len, args.repeats)
    print("| model | params | batch | engine tok/s | transformers tok/s | engine / transformers |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.model} | {r.params_m:.1f}M | {r.batch} | {r.engine_tps:,.0f} | "
              f"{r.hf_tps:,.0f} | {r.ratio:.2f} |")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    if len(rows) > 1:
        print(f"# geometric mean of the ratios: "
              f"{statistics.geometric_mean([r.ratio for r in rows]):.2f}")


if __name__ == "__main__":
    main()
