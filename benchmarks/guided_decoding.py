"""Cost of constrained decoding (issue 14): the reference engine in process, the same requests
with and without a JSON schema at 1, 16 and 64 concurrent streams, alternating --repeats times;
output tokens/s and per-request ITL (median over requests of (last token - first token) / (tokens
- 1)), and the grammar's compile time cold (new compiler) and cached.

The demo model (2 layers) makes the model's own step as cheap as it gets, so the grammar's share
of a step is at its largest here: an upper bound for real models, whose steps are longer while the
mask costs the same per token of vocabulary.

Usage (from the repository root):
    .venv/bin/python benchmarks/guided_decoding.py
    .venv/bin/python benchmarks/guided_decoding.py --model DIR --device cuda --streams 1 16 64
    PYTHONPATH=. python3 benchmarks/guided_decoding.py --shape 8b --device cuda   # lent GPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import shutil
import statistics
import tempfile
import time

from tandem.engines.args import EngineArgs
from tandem.engines.batching.engine import BatchingEngine
from tandem.engines.guided.matcher import Grammars
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.types import EngineRequest, GuidedDecoding, GuidedKind, SamplingParams
from tandem.model.demo import ensure_demo_model

#: A schema whose answers run long: a free string first (bounded), then more fields.
SCHEMA = {"type": "object", "properties": {
    "summary": {"type": "string", "maxLength": 300},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
    "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["summary", "tags", "score"]}
GUIDED = GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))


async def one_round(engine: BatchingEngine, streams: int, max_tokens: int, guided: bool,
                    tag: str) -> dict:
    async def run(i: int) -> tuple[int, float | None]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                  ignore_eos=not guided, guided=GUIDED if guided else None)
        stream = engine.add_request(EngineRequest(f"{tag}-{i}", (1, 2, 3, 4 + i % 50), sampling))
        times: list[float] = []
        count = 0
        async for chunk in stream:
            if chunk.token_ids:
                times.append(time.perf_counter())
                count += len(chunk.token_ids)
        itl = (times[-1] - times[0]) / (count - 1) if count > 1 and len(times) > 1 else None
        return count, itl

    start = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(streams)))
    seconds = time.perf_counter() - start
    tokens = sum(n for n, _ in results)
    itls = [itl for _, itl in results if itl is not None]
    return {"tok/s": tokens / seconds, "itl_ms": 1000 * statistics.median(itls),
            "tokens/request": tokens / streams}


def compile_times(model: str, vocab_size: int, eos: frozenset[int]) -> tuple[float, float]:
    grammars = Grammars.from_model_dir(model, vocab_size, eos)
    start = time.perf_counter()
    grammars.guide(GUIDED, (1, 2, 3))
    cold = time.perf_counter() - start
    start = time.perf_counter()
    grammars.guide(GUIDED, (1, 2, 3))
    return cold, time.perf_counter() - start


def dummy_8b(root: pathlib.Path) -> str:
    """A Llama-3.1-8B-shaped model directory (dummy weights, vocab 128,256) with the demo
    model's tokenizer: the grammar masks a real-sized vocabulary, the step costs a real step."""
    from benchmarks.reference_gpu import LLAMA_8B, write_config
    model = write_config(root / "llama8b", LLAMA_8B)
    for path in ensure_demo_model().iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(path, model / path.name)
    return str(model)


async def main_async(args: argparse.Namespace) -> None:
    tmp = tempfile.TemporaryDirectory()
    if args.shape == "8b":
        model = dummy_8b(pathlib.Path(tmp.name))
        engine_args = EngineArgs(model=model, device=args.device, dtype="bfloat16",
                                 load_format="dummy", num_gpu_blocks=4096)
    else:
        model = args.model or str(ensure_demo_model())
        engine_args = EngineArgs(model=model, device=args.device)
    engine = create_reference_engine(engine_args)
    assert isinstance(engine, BatchingEngine)
    await engine.start()
    rows: dict[tuple[int, bool], list[dict]] = {}
    try:
        await one_round(engine, 4, 8, True, "warm-g")  # load the tokenizer and compile once
        await one_round(engine, 4, 8, False, "warm")
        for r in range(args.repeats):
            for streams in args.streams:
                for guided in (False, True):
                    row = await one_round(engine, streams, args.max_tokens, guided,
                                          f"r{r}-{streams}-{guided}")
                    rows.setdefault((streams, guided), []).append(row)
        cold, cached = compile_times(model, engine.vocab_size, engine._eos_ids)
    finally:
        await engine.close()
        tmp.cleanup()
    print(f"\nreference engine, {model}, device {args.device}, max_tokens {args.max_tokens}, "
          f"temperature 1; median of {args.repeats} alternating rounds\n")
    print("| streams | unconstrained tok/s | JSON schema tok/s | unconstrained ITL ms | "
          "JSON schema ITL ms | ITL cost | tokens / request (schema) |")
    print("|---|---|---|---|---|---|---|")
    med = statistics.median
    for streams in args.streams:
        free, schema = rows[(streams, False)], rows[(streams, True)]
        itl_free, itl_schema = med(r["itl_ms"] for r in free), med(r["itl_ms"] for r in schema)
        print(f"| {streams} | {med(r['tok/s'] for r in free):.0f} | "
              f"{med(r['tok/s'] for r in schema):.0f} | {itl_free:.2f} | {itl_schema:.2f} | "
              f"{100 * (itl_schema / itl_free - 1):+.0f}% | "
              f"{med(r['tokens/request'] for r in schema):.0f} |")
    print(f"\ngrammar compile (this schema): cold {1000 * cold:.1f} ms, cached {1000 * cached:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: the demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=["model", "8b"], default="model",
                        help="8b: a Llama-3.1-8B shape with dummy bf16 weights and the demo "
                        "tokenizer (for --device cuda)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
