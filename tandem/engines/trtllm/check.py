"""`tandem check-engine --engine trtllm --model PATH`: a check users run on a GPU host.

It serves a few prompts aggregated and disaggregated (prefill, then decode from the KV handle)
on one engine instance, greedily, and compares the tokens; a TensorRT-LLM worker can serve both
legs itself once its cache transceiver is on, which the check turns on. Exit status 0 when
every prompt agrees. Tandem's CI runs it only against the fake TensorRT-LLM.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.engines.args import EngineArgs
from tandem.engines.base import Engine
from tandem.engines.registry import backend_names, create_engine
from tandem.engines.stream import RequestStream
from tandem.engines.trtllm.args import load_yaml, parse_override
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.errors import InvalidRequest
from tandem.runtime import config as config_lib


@dataclass(frozen=True)
class CheckRow:
    prompt_len: int
    aggregated: tuple[int, ...]
    disaggregated: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.aggregated == self.disaggregated


def check_prompts(vocab_size: int, num_prompts: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Deterministic prompts of 8 to 64 token ids (ids 0-99 avoided: often special tokens)."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)
    return [tuple(rng.randrange(low, vocab_size) for _ in range(rng.randint(8, 64)))
            for _ in range(num_prompts)]


def with_transceiver(args: EngineArgs) -> EngineArgs:
    """Turns TensorRT-LLM's cache transceiver on unless the user configured one."""
    override = parse_override(args.override_engine_args) if args.override_engine_args else {}
    from_file = load_yaml(args.extra_engine_args) if args.extra_engine_args else {}
    if "cache_transceiver_config" in override or "cache_transceiver_config" in from_file:
        return args
    override["cache_transceiver_config"] = {"backend": "DEFAULT"}
    return dataclasses.replace(args, override_engine_args=json.dumps(override))


async def _tokens(stream: RequestStream) -> tuple[int, ...]:
    out: list[int] = []
    async for chunk in stream:
        out.extend(chunk.token_ids)
    return tuple(out)


async def run_check(engine: Engine, prompts: Sequence[tuple[int, ...]],
                    max_tokens: int) -> list[CheckRow]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows = []
    for i, prompt in enumerate(prompts):
        agg = await _tokens(engine.add_request(EngineRequest(f"check-agg-{i}", prompt, greedy)))
        request = EngineRequest(f"check-pd-{i}", prompt, greedy)
        pre = await engine.prefill(request, lease_ms=60_000)
        if pre.kv_handle is None:  # finished on its first token
            pd: tuple[int, ...] = (pre.first_token.token_id,)
        else:
            pd = await _tokens(engine.add_request(dataclasses.replace(
                request, kv_handle=pre.kv_handle, first_token=pre.first_token)))
        rows.append(CheckRow(len(prompt), agg, pd))
    return rows


async def check_engine(name: str, args: EngineArgs, num_prompts: int = 4,
                       max_tokens: int = 16) -> list[CheckRow]:
    engine = create_engine(name, with_transceiver(args) if name == "trtllm" else args)
    await engine.start()
    try:
        vocab = getattr(getattr(engine, "model", None), "vocab_size", 32000)
        return await run_check(engine, check_prompts(vocab, num_prompts), max_tokens)
    finally:
        await engine.close()


@dataclass(frozen=True)
class CheckConfig:
    # == general ==
    #: Engine backend to check, by registry name.
    engine: str = "trtllm"
    #: Prompts run both ways.
    num_prompts: int = 4
    #: Greedy tokens generated per prompt.
    max_tokens: int = 16
    #: Engine flags (sections model and engine, KV cache, ...).
    engine_args: EngineArgs = field(default_factory=EngineArgs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `tandem check-engine`."""
    opts = config_lib.load(CheckConfig, argv, prog="tandem check-engine",
                           description="Run the same greedy prompts aggregated and "
                                       "disaggregated on one engine and compare the tokens.")
    if opts.engine not in backend_names():
        raise InvalidRequest(f"--engine must be one of {', '.join(backend_names())}, "
                             f"got '{opts.engine}'", param="engine")
    rows = asyncio.run(check_engine(opts.engine, opts.engine_args, opts.num_prompts,
                                    opts.max_tokens))
    print(f"{'prompt':>6} {'tokens':>6}  agreement")
    for i, row in enumerate(rows):
        where = next((j for j, (a, b) in enumerate(zip(row.aggregated, row.disaggregated))
                      if a != b), min(len(row.aggregated), len(row.disaggregated)))
        verdict = "same tokens" if row.ok else f"differ from token {where}"
        print(f"{i:>6} {len(row.aggregated):>6}  {verdict}")
    failed = sum(not row.ok for row in rows)
    print(f"{len(rows) - failed}/{len(rows)} prompts agree (aggregated vs disaggregated, "
          f"engine {opts.engine})")
    return 1 if failed else 0
