"""Incremental detokenization micro-benchmark: IncrementalDetokenizer per output token, decoding in
Python (the prefix/read-offset window) vs in Rust (`tokenizers`' DecodeStream).

One request's lifetime: a detokenizer for a chat prompt, a 200-token output added in chunks of
1 (plain decoding) or 8 (multi-step or speculative decoding), then finish(); without stop
strings and with two that never match (the stop-string stage then runs on every chunk). The
tokenizer is the demo model's byte-level BPE (4,096 tokens, as GPT-2, Llama 3 and Qwen are
built); outputs are English prose from its corpus, and text whose CJK characters and emoji span
several tokens. Times are CPU time, the best of --repeats runs of --requests requests each.

Usage (from the repository root):
    .venv/bin/python benchmarks/probes/detokenize.py
    .venv/bin/python benchmarks/probes/detokenize.py --baseline /tmp/old_detokenizer.py  # adds a column
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.demo import ensure_demo_model

NUM_TOKENS = 200
MIXED = ("你好，世界！我住在北京。東京タワー、こんにちは。emoji 😀🎉 👍🏽 🦊🦆 and text, "
         "café crème brûlée ½ ≤ ≥ ∞ € → ✓ ★ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ")
STOPS = ("never matches", "\n\n\n\n")

Factory = Callable[..., Any]


def _outputs(tok: Tokenizer) -> dict[str, list[int]]:
    corpus = resources.files("tandem.model").joinpath("demo_corpus.txt").read_text("utf-8")
    english = tok.encode(corpus, False)[1000:1000 + NUM_TOKENS]
    mixed = tok.encode(MIXED * 20, False)[:NUM_TOKENS]
    split = sum("\ufffd" in tok.decode([i]) for i in mixed)
    return {"english": english, f"CJK+emoji ({split} split)": mixed}


def _request(factory: Factory, tok: Tokenizer, prompt: list[int], ids: list[int], chunk: int,
             stop: tuple[str, ...]) -> str:
    detok = factory(tok, prompt, stop=stop)
    for i in range(0, len(ids), chunk):
        detok.add(ids[i:i + chunk])
    detok.finish()
    return str(detok.text)


def _us_per_token(paths: dict[str, Factory], tok: Tokenizer, prompt: list[int], ids: list[int],
                  chunk: int, stop: tuple[str, ...], requests: int,
                  repeats: int) -> dict[str, float]:
    """CPU time per output token of each path, the best of `repeats` runs interleaved across the
    paths (CPU time and interleaving: other processes on the machine skew all paths alike)."""
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, factory in paths.items():
            start = time.process_time()
            for _ in range(requests):
                _request(factory, tok, prompt, ids, chunk, stop)
            elapsed = (time.process_time() - start) / (requests * len(ids)) * 1e6
            best[name] = min(best[name], elapsed)
    return best


def _load_baseline(path: str) -> Factory:
    spec = importlib.util.spec_from_file_location("baseline_detokenizer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls: Factory = module.IncrementalDetokenizer
    return cls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--baseline", help="another detokenizer.py to time as well")
    args = parser.parse_args()
    tok = Tokenizer.from_dir(ensure_demo_model())
    prompt = tok.encode("<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n")
    paths: dict[str, Factory] = {}
    if args.baseline:
        paths["baseline"] = _load_baseline(args.baseline)
    paths["python"] = lambda *a, **k: IncrementalDetokenizer(*a, decode_stream=False, **k)
    paths["rust"] = IncrementalDetokenizer
    header = ["output", "chunk", "stops"] + [f"{name} us/tok" for name in paths]
    header += ["python/rust"] + (["baseline/rust"] if args.baseline else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, ids in _outputs(tok).items():
        for chunk in args.chunks:
            for stop in ((), STOPS):
                texts = {_request(f, tok, prompt, ids, chunk, stop) for f in paths.values()}
                assert len(texts) == 1, "the paths disagree"
                times = _us_per_token(paths, tok, prompt, ids, chunk, stop, args.requests,
                                      args.repeats)
                row = [label, str(chunk), "2" if stop else "0"]
                row += [f"{t:.2f}" for t in times.values()]
                row.append(f"{times['python'] / times['rust']:.2f}x")
                if args.baseline:
                    row.append(f"{times['baseline'] / times['rust']:.2f}x")
                print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
