"""Speculative decoding on a GPU (a script, not a test): prints the table of issue 44's goals.

One engine, a dummy-weight Llama-3.1-8B shape in bf16 with CUDA graphs; its speculation is
switched between runs (the engine reads `engine.speculation` each step):

1. one stream, plain decoding: output tokens/s and the step time;
2. one stream, an oracle proposer that proposes the target's own greedy continuation (recorded
   by run 1), k = 1..6: tokens/s, mean accepted length, the verify pass's time against a plain
   step (dummy weights cannot be predicted by a real proposer: this is the ceiling at
   acceptance 1.0 and the cost per position);
3. one stream, n-gram (prompt lookup) on a copy-heavy prompt: the plain continuation of a seed
   prompt is put into the prompt (seed + continuation + seed), so the answer can copy it;
4. batch sweep with the oracle (k = 4) against plain: where speculation stops paying (the
   default `disable_by_batch_size`);
5. 64 streams with the default policy (n-gram) against speculation off;
6. run 3 again on a target that copies (`copying_target`: the same kernels read the same
   bytes; the next token is a fixed permutation of the last, so the answer repeats the
   continuation the prompt holds, and prompt lookup finds it).

    PYTHONPATH=. python3 benchmarks/spec_gpu.py            # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/spec_gpu.py --small    # CPU smoke run of the script
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile
import time
from collections.abc import Sequence

import torch

from benchmarks.reference_gpu import LLAMA_8B, SMALL, prompts_of, write_config
from tandem.engines.args import EngineArgs
from tandem.engines.batching.request import BatchRequest
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.proposer import NgramProposer, Proposer
from tandem.engines.speculative.speculation import Speculation
from tandem.engines.types import EngineRequest, SamplingParams


def copying_target(model: torch.nn.Module) -> None:
    """Makes the dummy target copy (run 6), reading the same bytes through the same kernels:
    every layer's o_proj and down_proj zeroed, so the residual stream stays the last token's
    embedding, and the LM head's rows the embedding's rows permuted, so the next token is a
    fixed permutation of the last one, decisively (a row's dot product with itself is about
    sqrt(hidden) times its dot product with another; damping the layers instead left the
    context's share and bf16's near-tied logits, and the answer did not copy). The answer to
    the copy prompt then repeats the continuation the prompt holds."""
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = model.embed_tokens.weight
        if model.lm_head is not None:  # tied embeddings: the next token is the last one
            perm = torch.randperm(embedding.shape[0], generator=generator)
            model.lm_head.weight.copy_(embedding[perm.to(embedding.device)])


class OracleProposer(Proposer):
    """Proposes the continuation a plain greedy run produced for the same prompt."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations

    def propose(self, reqs: Sequence[BatchRequest], ks: Sequence[int],
                blocks: Sequence[list[int]] | None = None) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, ks, strict=True):
            known = self.continuations.get(tuple(req.token_ids[:req.num_prompt]), [])
            done = req.num_final - req.num_prompt
            out.append(known[done:done + k])
        return out


def speculation(method: str, k: int, proposer: Proposer | None = None,
                limit: int = 0) -> Speculation:
    obj: dict[str, object] = {"method": "ngram", "num_speculative_tokens": k,
                              "disable_by_batch_size": limit}
    if method == "ngram":
        obj.update(prompt_lookup_min=1, prompt_lookup_max=4)
    config = SpeculativeConfig.from_dict(obj)
    return Speculation(config, proposer or NgramProposer(config))


async def run(engine: ReferenceEngine, prompts: list[list[int]], max_tokens: int
              ) -> tuple[list[list[int]], float, int]:
    """(outputs, seconds from the first token to the last, engine steps in that span)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request(EngineRequest(f"s{i}-{time.monotonic_ns()}", tuple(p),
                                                params)) for i, p in enumerate(prompts)]
    first: list[float] = []
    steps0 = [0]

    async def collect(stream) -> list[int]:
        tokens: list[int] = []
        async for chunk in stream:
            if not tokens and chunk.token_ids:
                first.append(time.perf_counter())
                if len(first) == len(prompts):
                    steps0[0] = engine.num_steps
            tokens.extend(chunk.token_ids)
        return tokens

    outs = await asyncio.gather(*(collect(s) for s in streams))
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return list(outs), time.perf_counter() - max(first), engine.num_steps - steps0[0]


class HostTimes:
    """Seconds the step loop spends in each part of a step (wrapped engine methods), so that
    the step time can be split into the forward pass and the host's work around it."""

    PARTS = ("_propose", "_execute", "_apply")

    def __init__(self, engine: ReferenceEngine) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        for name in ("_execute", "_apply"):
            setattr(engine, name, self._timed(name, getattr(engine, name)))
        # Every Speculation's proposal round (the benchmark makes several).
        Speculation.propose = self._timed("_propose", Speculation.propose)  # type: ignore

    def _timed(self, name: str, method):
        is_async = asyncio.iscoroutinefunction(method)

        async def timed_async(*args):
            start = time.perf_counter()
            try:
                return await method(*args)
            finally:
                self.seconds[name] += time.perf_counter() - start

        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed_async if is_async else timed

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, dict.fromkeys(self.PARTS, 0.0)
        return out


def replays_ms(engine: ReferenceEngine, width_blocks: int) -> dict[int, float]:
    """GPU time of the decode graph of each batch bucket (back-to-back replays)."""
    graphs = engine.graphs
    out: dict[int, float] = {}
    if graphs is None:
        return out
    for (batch, width), (graph, _) in sorted(graphs.graphs.items()):
        if width != graphs.buckets(1, width_blocks)[1] or batch > 16:
            continue
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(30):
            graph.replay()
        torch.cuda.synchronize()
        out[batch] = 1000 * (time.perf_counter() - start) / 30
    return out


async def calibrated_oracle(engine: ReferenceEngine, prompts: list[list[int]],
                            outputs: list[list[int]], k: int, tokens: int) -> OracleProposer:
    """An oracle of the target's greedy continuation as verify passes compute it. In bf16 a
    verify pass (k + 1 rows) rounds differently from a one-row step, and dummy weights give
    near-tied logits, so plain decoding's continuation soon stops being the verify passes'
    own. A pass proposing it anyway computes that own continuation (every step has k + 1 rows
    while a proposal lasts, and a row's result does not depend on the other rows)."""
    engine.speculation = speculation(
        "oracle", k, OracleProposer({tuple(p): o + o for p, o in zip(prompts, outputs)}))
    outs, _, _ = await run(engine, prompts, tokens)
    return OracleProposer({tuple(p): o for p, o in zip(prompts, outs)})


async def ngram_on_copy_prompt(engine: ReferenceEngine, seed: list[int], tokens: int,
                               label: str, rows: list[tuple[str, ...]]) -> dict[str, float]:
    """One stream on a copy-heavy prompt (seed, the target's continuation of it, seed again),
    plain and with n-gram k = 4: appends the two table rows, returns the figures."""
    engine.speculation = None
    (cont,), _, _ = await run(engine, [seed], tokens)
    copy_prompt = [seed + cont + seed]
    (base,), secs, _ = await run(engine, copy_prompt, tokens)
    base_tps = (tokens - 1) / secs
    engine.speculation = speculation("ngram", 4)
    (out,), secs, steps = await run(engine, copy_prompt, tokens)
    passes, accepted = counters(engine)
    tps = (tokens - 1) / secs
    rows.append((f"1 stream, {label}copy prompt, plain", f"{base_tps:,.0f}", "1.00", "-", "-",
                 "-"))
    rows.append((f"1 stream, {label}copy prompt, n-gram k=4", f"{tps:,.0f}",
                 f"{tps / base_tps:.2f}", f"{1 + accepted / max(passes, 1):.2f}",
                 f"{1000 * secs / steps:.2f}",
                 f"{sum(a == b for a, b in zip(out, base)) / len(base):.0%} same tokens"))
    return {"tokens_per_s": tps, "plain_tokens_per_s": base_tps, "speedup": tps / base_tps,
            "mean_accepted": 1 + accepted / max(passes, 1)}


def counters(engine: ReferenceEngine) -> tuple[int, int]:
    spec = engine.speculation
    return (spec.counters.verify_passes, spec.counters.accepted_tokens) if spec else (0, 0)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shape, few tokens")
    parser.add_argument("--out", type=pathlib.Path, help="write the figures as JSON here")
    opts = parser.parse_args()
    shape = SMALL if opts.small else LLAMA_8B
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = 32 if opts.small else 256
    ctx = 64 if opts.small else 1024
    rows: list[tuple[str, ...]] = []
    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_config(pathlib.Path(tmp) / "llama8b", shape)
        engine = create_reference_engine(EngineArgs(
            model=str(model), device=device, load_format="dummy", kv_block_size=32,
            max_batch_size=320, num_gpu_blocks=4096 if not opts.small else 512))
        assert isinstance(engine, ReferenceEngine)
        await engine.start()
        vocab = shape["vocab_size"]
        prompt = prompts_of(1, ctx, vocab, salt=1)
        await run(engine, prompt, 8)  # warm
        # 1. plain, one stream.
        (plain,), secs, steps = await run(engine, prompt, tokens)
        plain_tps = (tokens - 1) / secs
        step_ms = 1000 * secs / steps
        rows.append(("1 stream, plain", f"{plain_tps:,.0f}", "1.00", "-", f"{step_ms:.2f}", "-"))
        figures["plain"] = {"tokens_per_s": plain_tps, "step_ms": step_ms}
        # 1b. plain without overlap scheduling: the host's work no longer hidden.
        times = HostTimes(engine)
        overlap, engine.overlap = engine.overlap, None
        _, secs, steps = await run(engine, prompt, tokens)
        engine.overlap = overlap
        full_ms = 1000 * secs / steps
        parts = {name: 1000 * v / steps for name, v in times.take().items()}
        rows.append(("1 stream, plain, no overlap", f"{(tokens - 1) / secs:,.0f}",
                     f"{(tokens - 1) / secs / plain_tps:.2f}", "-", f"{full_ms:.2f}",
                     "execute {_execute:.2f} + apply {_apply:.2f} ms/step".format(**parts)))
        figures["plain_no_overlap"] = {"step_ms": full_ms, **parts}
        replays = replays_ms(engine, -(-(ctx + tokens) // 32))
        figures["graph_replay_ms"] = replays
        rows.append(("decode graph replays", "-", "-", "-", "-",
                     ", ".join(f"b{b} {ms:.2f}" for b, ms in replays.items())))
        # 2. oracle, one stream, k = 1..6.
        for k in (1, 2, 3, 4, 6):
            oracle = await calibrated_oracle(engine, prompt, [plain], k, tokens)
            engine.speculation = speculation("oracle", k, oracle)
            times.take()
            (out,), secs, steps = await run(engine, prompt, tokens)
            parts = {name: 1000 * v / steps for name, v in times.take().items()}
            passes, accepted = counters(engine)
            tps = (tokens - 1) / secs
            verify_ms = 1000 * secs / steps
            same = sum(a == b for a, b in zip(out, plain)) / len(plain)
            rows.append((f"1 stream, oracle k={k}", f"{tps:,.0f}", f"{tps / plain_tps:.2f}",
                         f"{1 + accepted / max(passes, 1):.2f}", f"{verify_ms:.2f}",
                         f"{verify_ms / step_ms:.2f}x step, {verify_ms / full_ms:.2f}x full; "
                         "propose {_propose:.2f} execute {_execute:.2f} apply {_apply:.2f}; "
                         .format(**parts) + f"{same:.0%} = plain"))
            figures[f"oracle_k{k}"] = {"tokens_per_s": tps, "speedup": tps / plain_tps,
                                       "mean_accepted": 1 + accepted / max(passes, 1),
                                       "verify_ms": verify_ms, "same_tokens": same, **parts}
        # 3. n-gram on a copy-heavy prompt: the answer can copy the continuation it holds.
        seed = prompts_of(1, ctx // 2, vocab, salt=2)[0]
        figures["ngram_copy"] = await ngram_on_copy_prompt(engine, seed, tokens, "", rows)
        # 4. batch sweep, oracle k = 4 against plain.
        for batch in ((1, 2, 4) if opts.small else (2, 4, 8, 16, 32, 64)):
            prompts = prompts_of(batch, ctx, vocab, salt=3 + batch)
            engine.speculation = None
            outs, secs, _ = await run(engine, prompts, tokens)
            base_tps = batch * (tokens - 1) / secs
            oracle = await calibrated_oracle(engine, prompts, outs, 4, tokens)
            engine.speculation = speculation("oracle", 4, oracle)
            _, secs, _ = await run(engine, prompts, tokens)
            tps = batch * (tokens - 1) / secs
            rows.append((f"{batch} streams, oracle k=4 vs plain", f"{tps:,.0f}",
                         f"{tps / base_tps:.2f}", "-", "-", f"plain {base_tps:,.0f}"))
            figures[f"batch{batch}"] = {"plain": base_tps, "oracle_k4": tps}
        # 5. 64 streams: the default policy (n-gram) against off.
        batch = 4 if opts.small else 64
        prompts = prompts_of(batch, ctx, vocab, salt=99)
        results = {}
        for name, spec in (("off", None), ("default", speculation("ngram", 4, limit=8)),
                           ("off again", None)):
            engine.speculation = spec
            _, secs, _ = await run(engine, prompts, tokens)
            results[name] = batch * (tokens - 1) / secs
        off = (results["off"] + results["off again"]) / 2
        rows.append((f"{batch} streams, default policy vs off", f"{results['default']:,.0f}",
                     f"{results['default'] / off:.3f}", "-", "-",
                     f"off {results['off']:,.0f} / {results['off again']:,.0f}"))
        figures["policy64"] = results
        # 6. n-gram on the copy-heavy prompt with a target that copies (copying_target):
        # dummy weights never repeat what they wrote (run 3).
        copying_target(engine.model)
        figures["ngram_copying_target"] = await ngram_on_copy_prompt(
            engine, seed, tokens, "copying target, ", rows)
        await engine.close()
    header = ("run", "tokens/s", "vs plain", "mean accepted", "ms/step", "note")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if opts.out:
        opts.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
