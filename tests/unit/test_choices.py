"""OpenAI's `n` in the frontend: the choices' requests and seeds, their merged stream (the
others start after choice 0's first token, one failure fails all, closing cancels all), the
OpenAI bodies with several choices, and the router's preference for choice 0's workers."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from tandem.engines.types import FinishReason, SamplingParams, TokenLogprob, Usage
from tandem.errors import Unavailable
from tandem.frontend.choices import choice_requests, generate_choices, total_usage
from tandem.frontend.openai_request import parse_request
from tandem.frontend.openai_stream import OpenAIResponder
from tandem.frontend.pipeline import Delta, GenerationRequest
from tandem.routing.config import PoolConfig
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.workers import SlaHints, WorkerRef

DECODE = WorkerRef("d1", "127.0.0.1:1", "decode")
PREFILL = WorkerRef("p1", "127.0.0.1:2", "prefill")


def request(seed: int | None = None) -> GenerationRequest:
    return GenerationRequest("abc", [1, 2, 3], SamplingParams(max_tokens=4, seed=seed))


def test_each_choice_gets_its_id_and_seed_stream() -> None:
    reqs = choice_requests(request(seed=2**64 - 2), 3)
    assert [r.request_id for r in reqs] == ["abc", "abc-1", "abc-2"]
    assert [r.sampling.seed for r in reqs] == [2**64 - 2, 2**64 - 1, 0]  # wraps in uint64
    assert all(r.prompt_token_ids == [1, 2, 3] for r in reqs)
    unseeded = choice_requests(request(), 4)
    seeds = [r.sampling.seed for r in unseeded]
    assert seeds[0] is not None and seeds == [seeds[0] + i for i in range(4)]
    assert choice_requests(request(), 1) == [request()]  # n = 1: untouched, engine's own seed


class Fake:
    """A pipeline stand-in: each request yields `tokens` deltas, choice 0's first one from
    DECODE (and PREFILL); `fail` names a request id that fails after its first delta."""

    def __init__(self, tokens: int = 3, fail: str | None = None, block: str | None = None):
        self.tokens, self.fail, self.block = tokens, fail, block
        self.started: list[tuple[str, tuple[str, ...], int]] = []
        self.closed: list[str] = []
        self.emitted = 0

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        self.started.append((req.request_id, req.prefer_workers, self.emitted))
        try:
            for i in range(self.tokens):
                await asyncio.sleep(0)
                if req.request_id == self.block and i == 1:
                    await asyncio.Event().wait()  # never finishes by itself
                if req.request_id == self.fail and i == 1:
                    raise Unavailable("worker died")
                self.emitted += 1
                last = i == self.tokens - 1
                yield Delta(f"{req.request_id}:{i} ", [i], [],
                            FinishReason.LENGTH if last else None,
                            Usage(3, self.tokens, 2) if last else None, DECODE,
                            prefill_worker=PREFILL)
        finally:
            self.closed.append(req.request_id)


async def _collect(gen: AsyncGenerator[Delta, None]) -> list[Delta]:
    return [d async for d in gen]


async def test_the_others_start_after_choice_0s_first_token_on_its_workers() -> None:
    fake = Fake()
    deltas = await _collect(generate_choices(fake.generate, choice_requests(request(1), 3)))
    assert fake.started[0] == ("abc", (), 0)
    # Sent once choice 0's first delta was out, preferring the workers that computed it.
    assert [(rid, prefer) for rid, prefer, _ in fake.started[1:]] == [
        ("abc-1", ("d1", "p1")), ("abc-2", ("d1", "p1"))]
    assert all(emitted >= 1 for *_, emitted in fake.started[1:])
    by_index = {i: [d.text for d in deltas if d.index == i] for i in range(3)}
    rid = {0: "abc", 1: "abc-1", 2: "abc-2"}
    assert by_index == {i: [f"{rid[i]}:{t} " for t in range(3)] for i in range(3)}


async def test_one_failing_choice_fails_the_request_and_cancels_the_others() -> None:
    fake = Fake(tokens=5, fail="abc-2", block="abc-1")
    with pytest.raises(Unavailable, match="worker died"):
        await _collect(generate_choices(fake.generate, choice_requests(request(1), 3)))
    assert sorted(fake.closed) == ["abc", "abc-1", "abc-2"]  # every choice's stream closed


async def test_closing_the_stream_cancels_every_choice() -> None:
    fake = Fake(tokens=5, block="abc")
    gen = generate_choices(fake.generate, choice_requests(request(1), 2))
    first = await anext(gen)
    assert first.index == 0
    while len(fake.started) < 2:  # choice 1 is under way
        await asyncio.sleep(0)
    await gen.aclose()
    assert sorted(fake.closed) == ["abc", "abc-1"]


def _responder(body: dict) -> OpenAIResponder:
    return OpenAIResponder(parse_request(body, "completion"), "m", str)


def test_stream_events_carry_indexes_and_usage_follows_the_last_finish() -> None:
    r = _responder({"model": "m", "prompt": "x", "n": 2, "stream": True,
                    "stream_options": {"include_usage": True}})
    events = []
    for delta in (Delta("a", [1], [], index=1), Delta("b", [2], [], index=0),
                  Delta("", [], [], FinishReason.STOP, Usage(5, 3, 4), index=0),
                  Delta("c", [3], [], FinishReason.LENGTH, Usage(5, 2, 0), index=1)):
        events.extend(r.delta_events(delta))
    choices = [(e["choices"][0]["index"], e["choices"][0]["text"],
                e["choices"][0]["finish_reason"]) for e in events[:-1]]
    assert choices == [(1, "a", None), (0, "b", None), (0, "", "stop"), (1, "c", None),
                       (1, "", "length")]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert events[-1]["usage"]["prompt_tokens"] == 5
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


async def test_non_streamed_body_lists_every_choice() -> None:
    r = OpenAIResponder(parse_request({"model": "m", "n": 2, "messages": [
        {"role": "user", "content": "hi"}]}, "chat"), "m", str)

    async def deltas() -> AsyncGenerator[Delta, None]:
        yield Delta("one", [1], [], FinishReason.STOP, Usage(4, 1), index=1)
        yield Delta("zero", [2, 3], [], FinishReason.LENGTH, Usage(4, 2), index=0)

    body = json.loads(json.dumps(await r.collect(deltas())))
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in body["choices"]] == [(0, "zero", "length"), (1, "one", "stop")]
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] == 7


def test_total_usage_counts_the_prompt_once() -> None:
    assert total_usage({}) is None
    assert total_usage({1: Usage(9, 2, 0), 0: Usage(9, 3, 8)}) == Usage(9, 5, 8)
    # Speculative drafts are per choice, like completion tokens: every choice's count.
    assert total_usage({0: Usage(9, 3, 8, 2, 1), 1: Usage(9, 4, 0, 3, 0)}) == Usage(9, 7, 8, 5, 1)


def test_the_router_picks_preferred_workers_first() -> None:
    addrs = [f"127.0.0.1:{9300 + i}" for i in range(3)]
    router = Router([PoolConfig("decode", "decode", addrs, policy="round_robin")], None, 4, 1024)

    def pick(rid: str, prefer: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> list[str]:
        info = RouteRequestInfo(rid, [1, 2, 3], (), 3, 16, SlaHints(), exclude,
                                prefer_ids=prefer)
        return [w.worker_id for w in router.route(info).decode_workers]

    for i in range(6):  # whatever round robin's turn, the preferred worker comes first
        assert pick(f"r{i}", (addrs[1],))[0] == addrs[1]
    assert len(pick("all", (addrs[1],))) == 3  # the others stay as fallbacks
    assert pick("x", (addrs[1],), exclude=(addrs[1],))[0] != addrs[1]
    router.pools[0].workers[addrs[2]].healthy = False
    assert addrs[2] not in pick("y", (addrs[2],))  # never an unhealthy one


async def test_best_of_returns_the_likeliest_choices_renumbered() -> None:
    parsed = parse_request({"model": "m", "prompt": "x", "n": 2, "best_of": 3}, "completion")
    assert parsed.num_generated == 3
    assert parsed.sampling(4).top_logprobs == 0  # the ranking needs the sampled logprobs
    r = OpenAIResponder(parsed, "m", str)

    def lp(*values: float) -> list[TokenLogprob]:
        return [TokenLogprob(1, v) for v in values]

    async def deltas() -> AsyncGenerator[Delta, None]:
        yield Delta("worst", [1, 1], lp(-3.0, -3.0), FinishReason.LENGTH, Usage(4, 2), index=0)
        yield Delta("best", [1, 1], lp(-0.1, -0.3), FinishReason.LENGTH, Usage(4, 2), index=1)
        yield Delta("mid", [1], lp(-1.0), FinishReason.STOP, Usage(4, 1), index=2)

    body = await r.collect(deltas())
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "best"), (1, "mid")]
    assert all(c["logprobs"] is None for c in body["choices"])  # not asked for: not shown
    assert body["usage"]["completion_tokens"] == 5  # every generated choice counts
