"""Cost of constrained decoding (issues 14, 25): the reference engine in process, the same requests
with and without a JSON schema at 1, 16 and 64 concurrent streams, alternating --repeats times;
output tokens/s and per-request ITL (median over requests of (last token - first token) / (tokens
- 1)), and the grammar's compile time cold (new compiler) and cached.

The demo model (2 layers) makes the model's own step as cheap as it gets, so the grammar's share
of a step is at its largest here: an upper bound for real models, whose steps are longer while the
mask costs the same per token of vocabulary.

The host's grammar work is timed too: per step, the batch's mask fill (in the step's worker
thread, overlapping the GPU's forward pass; since issue 25 it also takes the tokens sampled the
step before into their grammars) and the grammar work on the event loop, between steps, as the
step's tokens are emitted. --padded-vocab runs as before issue 25: xgrammar on the model's whole
vocabulary (it then treats the ids past the tokenizer as special tokens and pays for each),
its thread pool for every batch fill, each token accepted on the event loop. --mask-costs
times fill and accept alone, per row, for that and for a synthetic 128k vocabulary of text.

Usage (from the repository root):
    .venv/bin/python benchmarks/guided_decoding.py
    .venv/bin/python benchmarks/guided_decoding.py --model DIR --device cuda --streams 1 16 64
    PYTHONPATH=. python3 benchmarks/guided_decoding.py --shape 8b --device cuda   # lent GPU
    .venv/bin/python benchmarks/guided_decoding.py --shape 8b --mask-costs      # no engine
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.batching.engine import BatchingEngine
from tandem.engines.guided import matcher
from tandem.engines.guided.matcher import Grammars, fill_bitmask
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
#: Each round's modes; --no-host-wait adds NO_WAIT, --switch-interval-ms SWITCHED ones.
MODES: tuple[str, ...] = ("free", "schema")
NO_WAIT = "schema, loop not waiting"
#: --steps-thread-masks: the mask filled on the steps' thread, between launches (before StepMasks).
STEPS_THREAD = "schema, mask on the steps' thread"
SWITCHED = ", switch {} ms"


def run_modes(args: argparse.Namespace) -> tuple[str, ...]:
    """The modes each round runs, in order: the free baseline first."""
    base = MODES + (NO_WAIT,) * args.no_host_wait + (STEPS_THREAD,) * args.steps_thread_masks
    return base + tuple(m + SWITCHED.format(ms) for ms in args.switch_interval_ms for m in base)


@contextlib.contextmanager
def mask_thread(engine: BatchingEngine, mode: str) -> Iterator[None]:
    """The engine's guided masks filled on their own thread (StepMasks, on CUDA), or, for
    STEPS_THREAD, on the steps' thread between launches, as before."""
    steps = getattr(engine, "overlap", None)
    own = steps.masks if steps is not None else None
    if own is not None and mode.startswith(STEPS_THREAD):
        steps.masks = None  # type: ignore[union-attr]
    try:
        yield
    finally:
        if steps is not None:
            steps.masks = own


@contextlib.contextmanager
def switch_interval(mode: str) -> Iterator[None]:
    """The interpreter's thread switch interval a mode names (sys.setswitchinterval), else its
    default: how long a thread that wants the GIL waits before it asks the holder to drop it."""
    import sys

    own = sys.getswitchinterval()
    if ", switch " in mode:
        sys.setswitchinterval(float(mode.rsplit(" ", 2)[1]) / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(own)


@contextlib.contextmanager
def loop_waits(wait: bool) -> Iterator[None]:
    """Whether the engine's loop waits for a guided launch's host work before it builds the
    next step (the default), or builds it while the grammars work."""
    from tandem.engines.batching.ahead import StepAhead
    from tandem.engines.reference.overlap import LaunchedStep

    own = LaunchedStep.host_done
    if not wait:
        LaunchedStep.host_done = StepAhead.host_done  # type: ignore[method-assign]
    try:
        yield
    finally:
        LaunchedStep.host_done = own  # type: ignore[method-assign]


class HostTimes:
    """The grammar's host work, timed by wrapping the engine's mask fill and Guide.accept."""

    def __init__(self) -> None:
        self.fills: list[tuple[int, float]] = []  # (guided rows, seconds) per step
        self.accepts = 0.0
        self.num_accepts = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def install(self) -> None:
        from tandem.engines.reference import engine as reference

        fill, accept, defer = reference.fill_bitmask, matcher.Guide.accept, matcher.Guide.defer

        def timed_fill(guides: Any, vocab_size: int) -> Any:
            start = time.perf_counter()
            out = fill(guides, vocab_size)
            rows = sum(g is not None for g in guides)
            if rows:
                self.fills.append((rows, time.perf_counter() - start))
            return out

        def timed(method: Callable[[Any, int], bool]) -> Callable[[Any, int], bool]:
            def timed_method(guide: Any, token_id: int) -> bool:
                start = time.perf_counter()
                ok = method(guide, token_id)
                self.accepts += time.perf_counter() - start
                self.num_accepts += 1
                return ok
            return timed_method

        reference.fill_bitmask = timed_fill  # type: ignore[assignment]
        matcher.Guide.accept = timed(accept)  # type: ignore[method-assign]
        matcher.Guide.defer = timed(defer)  # type: ignore[method-assign]

    def summary(self) -> dict:
        """Median fill ms per step (worker thread), and the grammar's ms per step on the event
        loop (accept or defer: their total over the steps that filled a mask)."""
        if not self.fills:
            return {}
        steps = len(self.fills)
        return {"fill_ms": 1000 * statistics.median(t for _, t in self.fills),
                "accept_ms": 1000 * self.accepts / steps,
                "rows": statistics.median(n for n, _ in self.fills)}


def padded_vocab() -> None:
    """Before issue 25: xgrammar matches against the model's whole vocabulary, its batch fill
    runs on its default thread pool (half the host's cores), and the event loop takes each
    sampled token into its grammar as it emits it."""
    import xgrammar

    matcher.grammar_vocab_size = lambda tokenizer, vocab_size, stop_ids: vocab_size
    pooled = xgrammar.BatchGrammarMatcher()
    matcher._batch_matcher = lambda: pooled
    accept = matcher.Guide.accept
    matcher.Guide.defer = lambda guide, token_id: accept(guide, token_id)  # type: ignore


def valid_json(text: str) -> bool:
    """Whether `text` is one JSON object of SCHEMA's shape (its fields, their types)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["summary"], str) and isinstance(value["tags"], list)
            and all(isinstance(t, str) for t in value["tags"])
            and isinstance(value["score"], int) and 0 <= value["score"] <= 100)


async def one_round(engine: BatchingEngine, streams: int, max_tokens: int, guided: bool,
                    tag: str, decode: Callable[[list[int]], str] | None = None) -> dict:
    """One round of `streams` requests; with `decode` (guided), how many stopped on their
    grammar's end and how many of those are valid JSON of the schema."""
    ends: list[tuple[list[int], str | None]] = []

    async def run(i: int) -> tuple[int, float | None, list[float]]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                  ignore_eos=not guided, guided=GUIDED if guided else None)
        stream = engine.add_request(EngineRequest(f"{tag}-{i}", (1, 2, 3, 4 + i % 50), sampling))
        times: list[float] = []
        count = 0
        ids: list[int] = []
        reason = None
        async for chunk in stream:
            if chunk.token_ids:
                times.append(time.perf_counter())
                count += len(chunk.token_ids)
                ids.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                reason = chunk.finish_reason.value
        ends.append((ids, reason))
        itl = (times[-1] - times[0]) / (count - 1) if count > 1 and len(times) > 1 else None
        return count, itl, [b - a for a, b in zip(times, times[1:])]

    start = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(streams)))
    seconds = time.perf_counter() - start
    tokens = sum(n for n, _, _ in results)
    itls = [itl for _, itl, _ in results if itl is not None]
    med = statistics.median
    # Where a request's ITL goes: its first gap, its usual one, and its gaps over twice its
    # usual (each the median over requests).
    gaps = [(g, med(g)) for _, _, g in results if len(g) > 1]
    stopped = [ids for ids, reason in ends if reason == "stop"]
    return {"stopped": len(stopped),
            "valid": sum(valid_json(decode(ids)) for ids in stopped) if decode else 0,
            "tok/s": tokens / seconds, "itl_ms": 1000 * med(itls),
            "tokens/request": tokens / streams,
            "first_gap_ms": 1000 * med(g[0] for g, _ in gaps) if gaps else 0.0,
            "gap_p50_ms": 1000 * med(usual for _, usual in gaps) if gaps else 0.0,
            "long_gaps": med(sum(x > 2 * usual for x in g) for g, usual in gaps) if gaps else 0}


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
    if args.padded_vocab:
        padded_vocab()
    if args.per_row_noise:  # before the batched kernel: a generator reseeded per row
        from tandem.engines.reference import draw_noise
        draw_noise.serves = lambda out: False  # type: ignore[assignment]
    engine = create_reference_engine(engine_args)
    assert isinstance(engine, BatchingEngine)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    await engine.start()
    host = HostTimes()
    host.install()
    phases = None
    if args.phases:
        from benchmarks.probes.step_phases import StepPhases
        phases = StepPhases(engine)
        phases.install()
    modes = run_modes(args)
    rows: dict[tuple[int, str], list[dict]] = {}
    try:
        await one_round(engine, 4, 8, True, "warm-g")  # load the tokenizer and compile once
        for streams in args.streams:  # every batch size once, both ways, before timing
            for guided in (False, True):
                await one_round(engine, streams, 8, guided, f"warm-{streams}-{guided}")
        for r in range(args.repeats):
            for streams in args.streams:
                for mode in modes:
                    host.reset()
                    if phases is not None:
                        phases.reset()
                    with (loop_waits(not mode.startswith(NO_WAIT)), switch_interval(mode),
                          mask_thread(engine, mode)):
                        row = await one_round(engine, streams, args.max_tokens,
                                              not mode.startswith("free"),
                                              f"r{r}-{streams}-{mode}", decode)
                    row.update(host.summary())
                    if phases is not None:
                        row["phases"] = phases.summary()
                    rows.setdefault((streams, mode), []).append(row)
        cold, cached = compile_times(model, engine.vocab_size, engine._eos_ids)
    finally:
        await engine.close()
        tmp.cleanup()
    vocab = "padded to the model's (before issue 25)" if args.padded_vocab else "the tokenizer's"
    print(f"\nreference engine, {model}, device {args.device}, max_tokens {args.max_tokens}, "
          f"temperature 1; median of {args.repeats} alternating rounds; grammar vocabulary "
          f"{vocab}; fill threads {matcher.fill_threads()}; sampler noise "
          f"{'per row' if args.per_row_noise else 'batched'}\n")
    print("| streams | unconstrained tok/s | JSON schema tok/s | unconstrained ITL ms | "
          "JSON schema ITL ms | ITL cost | tokens / request (schema) | valid JSON / stopped "
          "(schema, all rounds) | mask fill ms/step | grammar on the loop ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for streams in args.streams:
        for mode in modes:
            if mode.startswith("free"):
                continue
            at = mode.find(", switch")
            free = rows[(streams, "free" + (mode[at:] if at >= 0 else ""))]
            schema = rows[(streams, mode)]
            itl_free, itl_schema = (med(r["itl_ms"] for r in free),
                                    med(r["itl_ms"] for r in schema))
            label = streams if mode == "schema" else f"{streams} ({mode})"
            print(f"| {label} | {med(r['tok/s'] for r in free):.0f} | "
                  f"{med(r['tok/s'] for r in schema):.0f} | {itl_free:.2f} | {itl_schema:.2f} | "
                  f"{100 * (itl_schema / itl_free - 1):+.0f}% | "
                  f"{med(r['tokens/request'] for r in schema):.0f} | "
                  f"{sum(r['valid'] for r in schema)} / {sum(r['stopped'] for r in schema)} | "
                  f"{med(r.get('fill_ms', 0.0) for r in schema):.2f} | "
                  f"{med(r.get('accept_ms', 0.0) for r in schema):.2f} |")
    if phases is not None:
        print_phases(args.streams, modes, rows)
        print("\n| streams | mode | ITL ms | first gap ms | gap p50 ms | gaps > 2x p50 |")
        print("|---|---|---:|---:|---:|---:|")
        for streams in args.streams:
            for mode in modes:
                got = rows[(streams, mode)]
                print(f"| {streams} | {mode} | "
                      f"{med(r['itl_ms'] for r in got):.2f} | "
                      f"{med(r['first_gap_ms'] for r in got):.2f} | "
                      f"{med(r['gap_p50_ms'] for r in got):.2f} | "
                      f"{med(r['long_gaps'] for r in got):.0f} |")
    print(f"\ngrammar compile (this schema): cold {1000 * cold:.1f} ms, cached {1000 * cached:.3f} ms")


def print_phases(streams: list[int], modes: tuple[str, ...],
                 rows: dict[tuple[int, str], list[dict]]) -> None:
    """benchmarks/probes/step_phases.py's table: per stream count and mode, the median over rounds of
    each round's median ms per step."""
    from benchmarks.probes.step_phases import table

    out = []
    for n in streams:
        for mode in modes:
            summaries = [r["phases"] for r in rows[(n, mode)]]
            keys = {k for s in summaries for k in s}
            out.append((f"{n} {mode}",
                        {k: statistics.median(s[k] for s in summaries if k in s) for k in keys}))
    print("\nphases of the steps launched ahead, ms per step (benchmarks/probes/step_phases.py)\n")
    print(table(out))


def synthetic_grammars(model: str, vocab_size: int) -> Grammars:
    """A real-sized vocabulary of text: the tokenizer's tokens, then distinct concatenations of
    two of them (as BPE merges are) up to `vocab_size`; no padding ids."""
    import xgrammar

    base = Grammars.from_model_dir(model, 4096, [1]).decoded_vocab
    texts = [t for t in base if t]
    rng = random.Random(0)
    vocab, seen = list(base), set(base)
    while len(vocab) < vocab_size:
        token = rng.choice(texts) + rng.choice(texts)
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                  stop_token_ids=[1])
    return Grammars(info)


def walk(grammars: Grammars, vocab_size: int, rows: int, steps: int) -> tuple[float, float]:
    """`rows` guides walked `steps` tokens (random allowed ones): median ms per step of the
    batch fill and of the accepts (one by one)."""
    rng = random.Random(rows)
    guides = [grammars.guide(GUIDED, ()) for _ in range(rows)]
    fills: list[float] = []
    accepts: list[float] = []
    for _ in range(steps):
        live = [g for g in guides if not g.is_terminated]
        if len(live) < rows // 2:
            break
        start = time.perf_counter()
        bitmask = fill_bitmask(live, vocab_size)
        fills.append(time.perf_counter() - start)
        assert bitmask is not None
        words = bitmask.to(torch.int64) & 0xFFFFFFFF
        bits = ((words.unsqueeze(-1) >> torch.arange(32)) & 1).flatten(1)[:, :vocab_size]
        tokens = [rng.choice(row.nonzero().flatten().tolist()) for row in bits]
        start = time.perf_counter()
        assert all(guide.accept(token) for guide, token in zip(live, tokens, strict=True))
        accepts.append(time.perf_counter() - start)
    return 1000 * statistics.median(fills), 1000 * statistics.median(accepts)


def mask_costs(args: argparse.Namespace) -> None:
    """The grammar's host work alone, per step of `rows` guided rows, no engine: the demo
    tokenizer padded to the 8B model's 128,256 ids (before issue 25), the same with xgrammar on
    the tokenizer's ids (now), and a synthetic 128,256-token vocabulary of text (a real one)."""
    import xgrammar

    vocab_size = 128256
    with tempfile.TemporaryDirectory() as tmp:
        model = dummy_8b(pathlib.Path(tmp)) if args.shape == "8b" else (
            args.model or str(ensure_demo_model()))
        real_vocab = matcher.grammar_vocab_size
        cases: list[tuple[str, Callable[[], Grammars]]] = [
            ("demo tokenizer padded (before)", lambda: (padded_vocab(), Grammars.from_model_dir(
                model, vocab_size, [1]))[1]),
            ("demo tokenizer, xgrammar on its ids (now)", lambda: (
                setattr(matcher, "grammar_vocab_size", real_vocab),
                Grammars.from_model_dir(model, vocab_size, [1]))[1]),
            ("synthetic 128k text vocabulary", lambda: synthetic_grammars(model, vocab_size))]
        threads = sorted({1, matcher.fill_threads()})
        own_batch_matcher = matcher._batch_matcher
        print(f"\ngrammar host work per step (median of up to {args.max_tokens} steps), "
              f"JSON schema, random allowed tokens\n")
        print("| vocabulary | rows | fill threads | mask fill ms/step | accepts ms/step | "
              "fill us/row | accept us/row |")
        print("|---|---|---|---|---|---|---|")
        for name, make in cases:
            grammars = make()
            for rows in args.streams:
                for n in threads:
                    batch = xgrammar.BatchGrammarMatcher(n)
                    matcher._batch_matcher = lambda batch=batch: batch
                    fill, accept = walk(grammars, vocab_size, rows, args.max_tokens)
                    print(f"| {name} | {rows} | {n} | {fill:.2f} | {accept:.2f} | "
                          f"{1000 * fill / rows:.0f} | {1000 * accept / rows:.1f} |")
        matcher._batch_matcher = own_batch_matcher


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
    parser.add_argument("--padded-vocab", action="store_true",
                        help="xgrammar on the model's whole vocabulary, as before issue 25")
    parser.add_argument("--phases", action="store_true",
                        help="time each phase of the steps launched ahead (benchmarks/probes/step_phases.py)")
    parser.add_argument("--per-row-noise", action="store_true",
                        help="the sampler's noise one row at a time, as before draw_noise")
    parser.add_argument("--no-host-wait", action="store_true",
                        help="also run the schema with the loop building the next step while "
                        "a guided launch's grammars work (not waiting for its host_done)")
    parser.add_argument("--steps-thread-masks", action="store_true",
                        help="also run the schema with its masks filled on the steps' thread "
                        "between launches, as before the mask thread (CUDA)")
    parser.add_argument("--switch-interval-ms", type=float, nargs="*", default=[],
                        help="also run every mode with the interpreter's thread switch "
                        "interval at each of these (default 5 ms)")
    parser.add_argument("--mask-costs", action="store_true",
                        help="time the grammar's host work alone (no engine) and exit")
    args = parser.parse_args()
    if args.mask_costs:
        mask_costs(args)
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
