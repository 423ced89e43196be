"""Speculative decoding on the CPU with the demo model and its draft (a script, not a test).

One stream at a time, greedy, through the reference engine: plain decoding, the demo's
distilled draft (`--speculative-config` draft_model, k = 2 and 4) and prompt lookup (ngram,
k = 4), on the prompt sets `python -m tandem.model.draft_eval` reports on (held-out corpus
prompts, chat messages the corpus does not hold). Prints, per run: output tokens/s over the
decode phase, tokens per verify pass (mean accepted length), acceptance rate, and whether the
tokens equal plain decoding's.

    .venv/bin/python benchmarks/spec_cpu.py [--max-tokens 64] [--prompts 12]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from tokenizers import Tokenizer

from tandem.engines.args import EngineArgs
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model import demo, draft_eval


async def one_stream(engine: ReferenceEngine, prompts: list[list[int]], max_tokens: int
                     ) -> tuple[list[list[int]], float, int]:
    """Each prompt alone; (outputs, decode seconds, decode tokens)."""
    await engine.start()
    outs, seconds, tokens = [], 0.0, 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        stream = engine.add_request(EngineRequest(f"p{i}-{time.monotonic_ns()}", tuple(prompt),
                                                  params))
        out: list[int] = []
        first = 0.0
        async for chunk in stream:
            if not out and chunk.token_ids:
                first = time.perf_counter()
            out.extend(chunk.token_ids)
        seconds += time.perf_counter() - first
        tokens += len(out) - 1
        outs.append(out)
    await engine.close()
    return outs, seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=12, help="prompts per set")
    opts = parser.parse_args()
    model = demo.ensure_demo_model()
    draft = demo.draft_model_dir(model)
    sets = draft_eval.eval_prompts(Tokenizer.from_file(str(model / "tokenizer.json")))
    configs = {
        "plain": "",
        "draft k=2": {"method": "draft_model", "num_speculative_tokens": 2},
        "draft k=4": {"method": "draft_model", "num_speculative_tokens": 4},
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 4},
    }
    print("| prompts | run | tokens/s | vs plain | tokens per verify pass | acceptance "
          "| same tokens |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, prompts in sets.items():
        prompts = prompts[:opts.prompts]
        base_outs: list[list[int]] = []
        base_rate = 0.0
        for run, config in configs.items():
            if isinstance(config, dict):
                config = {**config, "disable_by_batch_size": 0}
                if config["method"] == "draft_model":
                    config["model"] = str(draft)
            engine = create_reference_engine(EngineArgs(
                model=str(model), device="cpu", speculative_config=json.dumps(config)
                if config else ""))
            assert isinstance(engine, ReferenceEngine)
            outs, seconds, tokens = asyncio.run(one_stream(engine, prompts, opts.max_tokens))
            rate = tokens / seconds
            spec = engine.speculation
            if spec is None:
                base_outs, base_rate = outs, rate
                print(f"| {name} | {run} | {rate:,.0f} | 1.00 | - | - | - |")
                continue
            c = spec.counters
            print(f"| {name} | {run} | {rate:,.0f} | {rate / base_rate:.2f} | "
                  f"{c.mean_accepted_length:.2f} | "
                  f"{c.accepted_tokens / max(c.proposed_tokens, 1):.0%} | "
                  f"{'yes' if outs == base_outs else 'NO'} |")


if __name__ == "__main__":
    main()
