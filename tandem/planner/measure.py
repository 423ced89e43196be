"""One point of a capacity profile, measured against a running worker (tandem.planner.profiler
runs the sweep).

- **Prefill point**: prompts of one length arrive as a Poisson process at an offered rate of
  prompt tokens per second; the TTFT of each (request sent -> first token back) is measured by
  the client, as the frontend's histogram measures it, and the point is its p90. The rates are
  set against `saturation_tokens_per_s`: what the worker gets through when a burst arrives at
  once (it batches them as it would under load).
- **Decode point**: `batch_size` streams start together, each with a prompt of
  `context_length - osl / 2` tokens and `osl` tokens to generate, so that a stream holds
  `context_length` tokens on average while it decodes. Each prompt has run once before, for
  one token, so its KV is in the worker's prefix cache and the streams start decoding within
  a step or two of each other, as on a disaggregated decode worker whose KV arrives computed;
  computed there, 64 prompts of 8k tokens would keep the first streams decoding beside
  prompts (and finishing) long before the last one starts. Only the window in which every
  stream decodes counts (from the last stream's first token to the first stream's last): the
  batch is then exactly `batch_size` and no prompt runs beside it. Each chunk is one ITL
  sample of gap / tokens in it (the frontend's ITL histogram), and the point is their p90.

The worker is reached through two callables, so that this module needs no channel: a
`FirstToken` (a prefill worker's Prefill call, or the first chunk of a Generate stream) and a
`TokenCounts` stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from tandem.engines.types import EngineRequest, SamplingParams
from tandem.errors import Overloaded

#: Sends one request and returns once its first token is back.
FirstToken = Callable[[EngineRequest], Awaitable[None]]
#: Streams one request, yielding the number of tokens of each chunk as it arrives.
TokenCounts = Callable[[EngineRequest], AsyncGenerator[int, None]]
#: Prompt token ids are drawn from this range: above the special tokens of small vocabularies
#: (the demo model's are below 16) and inside any real model's vocabulary (4096: the demo's).
TOKEN_IDS = range(16, 4096)


class Prompts:
    """Prompts of random token ids: two of them share no first KV block (the odds of equal
    first blocks are nil), so no prompt hits the worker's prefix cache and every point
    measures computed prompts."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._num_made = 0

    def request(self, isl: int, max_tokens: int) -> EngineRequest:
        self._num_made += 1
        ids = tuple(self._rng.choice(TOKEN_IDS) for _ in range(isl))
        return EngineRequest(f"profile-{self._num_made}", ids,
                             SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                            ignore_eos=True))


def p90(values: Sequence[float]) -> float:
    """The 90th percentile, linear between neighbours. Raises ValueError when empty."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * 0.9
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class PrefillRun:
    isl: int
    #: Prompt tokens per second offered (arrival rate x ISL).
    tokens_per_s: float
    #: p90 TTFT of the requests that were served, ms.
    ttft_ms: float
    num_requests: int
    #: Requests the worker refused (RESOURCE_EXHAUSTED: its queue was full).
    num_refused: int


@dataclass(frozen=True)
class DecodeRun:
    context_length: int
    batch_size: int
    #: p90 of the ITL samples in the steady window, ms.
    itl_ms: float
    num_samples: int


async def saturation_tokens_per_s(first_token: FirstToken, prompts: Prompts, isl: int,
                                  num_requests: int) -> float:
    """Prompt tokens per second the worker gets through when `num_requests` prompts of `isl`
    tokens arrive at once: sent together, timed until the last first token."""
    requests = [prompts.request(isl, 1) for _ in range(num_requests)]
    start = time.perf_counter()
    await asyncio.gather(*(first_token(r) for r in requests))
    return num_requests * isl / (time.perf_counter() - start)


async def prefill_run(first_token: FirstToken, prompts: Prompts, isl: int, tokens_per_s: float,
                      num_requests: int, seed: int) -> PrefillRun:
    """`num_requests` prompts of `isl` tokens arriving as a Poisson process of
    `tokens_per_s / isl` per second (whatever is in flight), each asking one token."""
    rng = random.Random(seed)
    rate = tokens_per_s / isl
    requests = [prompts.request(isl, 1) for _ in range(num_requests)]
    start, at = time.perf_counter(), 0.0
    tasks = []
    for request in requests:
        if (delay := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_timed(first_token, request)))
        at += rng.expovariate(rate)
    results = await asyncio.gather(*tasks)
    ttfts = [ms for ms in results if ms is not None]
    if not ttfts:
        raise Overloaded(f"the worker refused all {num_requests} prompts of {isl} tokens at "
                         f"{tokens_per_s:.0f} tokens/s")
    return PrefillRun(isl, tokens_per_s, p90(ttfts), num_requests, len(results) - len(ttfts))


async def _timed(first_token: FirstToken, request: EngineRequest) -> float | None:
    """The request's TTFT in ms; None when the worker refused it for load."""
    start = time.perf_counter()
    try:
        await first_token(request)
    except Overloaded:
        return None
    return 1000 * (time.perf_counter() - start)


async def decode_run(stream: TokenCounts, prompts: Prompts, context_length: int,
                     batch_size: int, osl: int) -> DecodeRun:
    """`batch_size` streams of `osl` tokens each at an average context of `context_length`
    (see the module docstring). Raises ValueError when the context cannot hold half the
    output beside a prompt."""
    isl = context_length - osl // 2
    if isl < 1 or osl < 2:
        raise ValueError(f"a decode point needs osl >= 2 and context_length > osl / 2, got "
                         f"context_length {context_length}, osl {osl}")
    requests = [prompts.request(isl, osl) for _ in range(batch_size)]
    await asyncio.gather(*(first_token_of(stream, _one_token(r)) for r in requests))
    arrivals = await asyncio.gather(*(_arrivals(stream, r) for r in requests))
    begin = max(chunks[0][0] for chunks in arrivals)
    end = min(chunks[-1][0] for chunks in arrivals)
    samples = [(t - prev) / n for chunks in arrivals
               for (prev, _), (t, n) in zip(chunks, chunks[1:]) if begin <= prev and t <= end]
    if not samples:  # streams too short to overlap in steady state: every gap after the first
        samples = [(t - prev) / n for chunks in arrivals
                   for (prev, _), (t, n) in zip(chunks, chunks[1:])]
    return DecodeRun(context_length, batch_size, 1000 * p90(samples), len(samples))


def _one_token(request: EngineRequest) -> EngineRequest:
    """The same prompt under its own id, asking one token: it leaves the prompt's KV cached."""
    return dataclasses.replace(request, request_id=f"{request.request_id}-cache",
                               sampling=dataclasses.replace(request.sampling, max_tokens=1))


async def first_token_of(stream: TokenCounts, request: EngineRequest) -> None:
    """Streams `request` until its first token; closing the stream then cancels the rest."""
    async with contextlib.aclosing(stream(request)) as counts:
        async for n in counts:
            if n:
                return


async def _arrivals(stream: TokenCounts, request: EngineRequest) -> list[tuple[float, int]]:
    """(arrival time, tokens) of each chunk of one stream that carries tokens."""
    chunks = [(time.perf_counter(), n) async for n in stream(request) if n]
    if len(chunks) < 2:
        raise ValueError(f"request {request.request_id} streamed {len(chunks)} chunks; an ITL "
                         "needs two")
    return chunks


def requests_for(tokens_per_s: float, isl: int, min_requests: int, point_s: float) -> int:
    """Requests a prefill point sends: enough for `point_s` seconds at its rate, at least
    `min_requests` (a p90 needs some) and at most 8x that (a fast worker at short prompts
    would otherwise be sent more than one client process can time)."""
    return min(8 * min_requests, max(min_requests, math.ceil(tokens_per_s / isl * point_s)))
