"""Migration: a decode stream that breaks midway (the worker died, the stream failed or ended
unfinished) is re-issued to another decode worker with the tokens so far appended to the prompt
and max_tokens reduced, and the client sees one stream, equal to an uninterrupted one. The
router and workers are scripted stand-ins for the ports; the pipeline, detokenizer and tokenizer
are the real ones. The workers play a deterministic "model" whose next token depends only on the
sequence so far, as greedy decoding does."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence

import pytest

from tandem.engines.types import (
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    KvHandle,
    KvLayout,
    PrefillResult,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
    Usage,
)
from tandem.errors import Unavailable, UpstreamError
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.pipeline import Delta, GenerationRequest, Pipeline
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.demo import ensure_demo_model
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef

WORKERS = [WorkerRef(n, n, "decode") for n in ("a", "b", "c")]
PREFILL_WORKERS = [WorkerRef(n, n, "prefill") for n in ("p1", "p2")]
PROMPT = [10, 11, 12, 13]
TEXT = "one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model())


@pytest.fixture(scope="module")
def script(tokenizer: Tokenizer) -> list[int]:
    """What the model answers to PROMPT, token by token."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) >= 12
    return ids


class ScriptedRouter:
    def __init__(self, prefill: bool = False) -> None:
        self.prefill = prefill
        self.excluded: list[tuple[str, ...]] = []
        self.routed_prompts: list[list[int]] = []
        self.completed: list[tuple[str, int]] = []

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision:
        self.excluded.append(tuple(exclude_ids))
        self.routed_prompts.append(list(token_ids))
        workers = tuple(w for w in WORKERS if w.worker_id not in exclude_ids)
        if not workers:
            raise Unavailable("no healthy worker in any eligible pool")
        if self.prefill:
            return RouteDecision(workers, tuple(PREFILL_WORKERS), disaggregate=True)
        return RouteDecision(workers)

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        self.completed.append((outcome, output_tokens))


class ScriptedWorkers:
    """Decode workers that continue `script` after PROMPT, two tokens a chunk. A worker in
    `breaks` fails the way given after sending that many tokens (its own, not counting the
    prompt), or sends everything but the finish ("no finish"); one in `hangs` sends that many and then waits until cancelled."""

    def __init__(self, script: list[int], breaks: dict[str, tuple[int, str]] | None = None,
                 hangs: dict[str, int] | None = None,
                 predictions: tuple[int, int] = (0, 0)) -> None:
        self.script = script
        self.breaks = breaks or {}
        self.hangs = hangs or {}
        #: Speculative drafts accepted and rejected, reported in the last chunk's usage.
        self.predictions = predictions
        self.requests: list[tuple[str, EngineRequest]] = []
        self.cancelled = asyncio.Event()

    @property
    def calls(self) -> list[str]:
        return [address for address, _ in self.requests]

    async def generate(self, address: str, request: EngineRequest,
                       timeout_s: float | None = None) -> AsyncGenerator[TokenChunk, None]:
        self.requests.append((address, request))
        done = len(request.prompt_token_ids) - len(PROMPT)
        assert list(request.prompt_token_ids) == PROMPT + self.script[:done]
        todo = self.script[done:done + request.sampling.max_tokens]
        stop_after, how = self.breaks.get(address, (len(todo) + 1, ""))
        hang_after = self.hangs.get(address)
        for start in range(0, len(todo), 2):
            if hang_after is not None and start >= hang_after:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled.set()
                    if address in self.breaks:  # the transport reports the cancel as a failure
                        raise Unavailable(f"{address}: connection closed") from None
                    raise
            if start >= stop_after:
                if how == "died":
                    raise Unavailable(f"{address} unavailable: Socket closed")
                if how == "internal":
                    raise UpstreamError(f"{address} failed (INTERNAL): RST_STREAM")
                return  # "unfinished": the stream ends without a finish
            piece = todo[start:start + 2]
            last = start + 2 >= len(todo) and how != "no finish"
            yield TokenChunk(piece, [TokenLogprob(t, -0.5) for t in piece],
                             FinishReason.LENGTH if last else None,
                             Usage(len(request.prompt_token_ids), len(todo), 3,
                                   *self.predictions) if last else None,
                             cached_tokens=2 if start == 0 else None)


class ScriptedPrefill:
    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.calls: list[str] = []
        self.released: list[KvHandle] = []

    async def prefill(self, address: str, request: EngineRequest,
                      timeout_s: float | None = None) -> PrefillResult:
        self.calls.append(address)
        if address in self.failing:
            raise Unavailable(f"{address} unavailable: Connection refused")
        handle = KvHandle(address, address, request.request_id, "mock",
                          KvLayout("float32", 2, 2, 16, 32), len(request.prompt_token_ids))
        return PrefillResult(TokenLogprob(0, -0.1), handle, cached_tokens=1)

    def release(self, handle: KvHandle) -> None:
        self.released.append(handle)


def make_pipeline(tokenizer: Tokenizer, router: ScriptedRouter, workers: ScriptedWorkers,
                  migration_limit: int = 2, prefill: ScriptedPrefill | None = None) -> Pipeline:
    return Pipeline(router, workers, lambda req: IncrementalDetokenizer(
        tokenizer, req.prompt_token_ids, stop=req.stop,
        skip_special_tokens=req.skip_special_tokens), FrontendMetrics("m"), prefill,
        migration_limit=migration_limit)


def request(max_tokens: int = 10, **sampling: int) -> GenerationRequest:
    return GenerationRequest("r1", list(PROMPT), SamplingParams(max_tokens=max_tokens,
                                                                **sampling))


async def collect(pipeline: Pipeline, req: GenerationRequest) -> list[Delta]:
    return [d async for d in pipeline.generate(req)]


def joined(deltas: list[Delta]) -> tuple[str, list[int]]:
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


async def uninterrupted(tokenizer: Tokenizer, script: list[int],
                        req: GenerationRequest) -> list[Delta]:
    return await collect(make_pipeline(tokenizer, ScriptedRouter(), ScriptedWorkers(script)), req)


@pytest.mark.parametrize("how", ["died", "internal", "unfinished"])
async def test_a_broken_stream_continues_on_another_worker(tokenizer: Tokenizer,
                                                           script: list[int], how: str) -> None:
    req = request(10, min_tokens=6)
    router, workers = ScriptedRouter(), ScriptedWorkers(script, {"a": (4, how)})
    deltas = await collect(make_pipeline(tokenizer, router, workers), req)
    want = await uninterrupted(tokenizer, script, req)

    assert joined(deltas) == joined(want) == (tokenizer.decode(script[:10]), script[:10])
    assert [lp.token_id for d in deltas for lp in d.logprobs] == script[:10]
    # Re-issued to the router's next pick, excluding the failed worker, with the 4 tokens the
    # client has in the prompt, 4 fewer to go, and no KV handle.
    assert workers.calls == ["a", "b"] and router.excluded == [(), ("a",)]
    resumed = workers.requests[1][1]
    assert list(resumed.prompt_token_ids) == PROMPT + script[:4]
    assert router.routed_prompts[1] == PROMPT + script[:4]
    assert resumed.sampling.max_tokens == 6 and resumed.sampling.min_tokens == 2
    assert resumed.request_id == req.request_id and resumed.kv_handle is None
    assert [d.worker.worker_id for d in deltas if d.token_ids] == ["a", "a", "b", "b", "b"]
    # Usage counts the client's prompt (and its cache hits on the first worker), and every
    # generated token once.
    last = deltas[-1]
    assert last.finish_reason == FinishReason.LENGTH
    assert last.usage == Usage(len(PROMPT), 10, 2)
    assert router.completed == [("ok", 10)]


async def test_speculative_counts_come_from_the_worker_that_finished(tokenizer: Tokenizer,
                                                                    script: list[int]) -> None:
    # The broken worker never sent its usage: only the finishing worker's drafts are counted.
    workers = ScriptedWorkers(script, {"a": (4, "died")}, predictions=(5, 1))
    deltas = await collect(make_pipeline(tokenizer, ScriptedRouter(), workers), request(10))
    assert workers.calls == ["a", "b"]
    assert deltas[-1].usage == Usage(len(PROMPT), 10, 2, accepted_prediction_tokens=5,
                                     rejected_prediction_tokens=1)
    assert all(d.usage is None for d in deltas[:-1])


async def test_each_migration_starts_from_everything_so_far(tokenizer: Tokenizer,
                                                            script: list[int]) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers(script, {"a": (2, "died"), "b": (4, "internal")})
    pipeline = make_pipeline(tokenizer, router, workers)
    deltas = await collect(pipeline, request(12))
    assert pipeline.metrics.registry.get_sample_value("tandem_frontend_migrations_total",
                                                      {"model": "m"}) == 2
    assert joined(deltas)[1] == script[:12]
    assert workers.calls == ["a", "b", "c"] and router.excluded == [(), ("a",), ("a", "b")]
    assert [len(r.prompt_token_ids) - len(PROMPT) for _, r in workers.requests] == [0, 2, 6]
    assert [r.sampling.max_tokens for _, r in workers.requests] == [12, 10, 6]
    assert deltas[-1].usage == Usage(len(PROMPT), 12, 2)


async def test_a_stop_string_across_the_break_is_found_once(tokenizer: Tokenizer,
                                                            script: list[int]) -> None:
    # The detokenizer carries over: text it held back as a possible stop string's start on the
    # first worker completes the stop string with the second worker's tokens.
    words = TEXT.split()
    stop = f"{words[3]} {words[4]}"  # "four five"
    assert len(tokenizer.encode(" " + words[3], add_special_tokens=False)) == 1
    split = tokenizer.encode(" ".join(words[:4]), add_special_tokens=False)
    req = dataclasses.replace(request(12), stop=(stop,))
    workers = ScriptedWorkers(script, {"a": (len(split), "died")})
    deltas = await collect(make_pipeline(tokenizer, ScriptedRouter(), workers), req)
    want = await uninterrupted(tokenizer, script, req)
    assert workers.calls == ["a", "b"]
    assert joined(deltas) == joined(want)
    assert joined(deltas)[0] == " ".join(words[:3]) + " "
    assert deltas[-1].finish_reason == FinishReason.STOP == want[-1].finish_reason
    assert deltas[-1].usage == want[-1].usage


async def test_the_limit_bounds_migrations(tokenizer: Tokenizer, script: list[int]) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers(script, {"a": (2, "died"), "b": (2, "internal")})
    with pytest.raises(UpstreamError, match="RST_STREAM"):
        await collect(make_pipeline(tokenizer, router, workers, migration_limit=1), request())
    assert workers.calls == ["a", "b"]
    assert router.completed == [("error", 4)]


async def test_limit_zero_turns_migration_off(tokenizer: Tokenizer, script: list[int]) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers(script, {"a": (4, "died")})
    gen = make_pipeline(tokenizer, router, workers, migration_limit=0).generate(request())
    received: list[int] = []
    with pytest.raises(Unavailable, match="Socket closed"):
        async for delta in gen:
            received += delta.token_ids
    assert received == script[:4]
    assert workers.calls == ["a"] and router.excluded == [()]
    assert router.completed == [("error", 4)]


async def test_without_another_worker_the_failure_surfaces(tokenizer: Tokenizer,
                                                           script: list[int]) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers(script, {w.worker_id: (2, "died") for w in WORKERS})
    with pytest.raises(Unavailable, match="c unavailable"):
        await collect(make_pipeline(tokenizer, router, workers, migration_limit=5), request())
    assert router.excluded == [(), ("a",), ("a", "b"), ("a", "b", "c")]


async def test_a_stream_that_had_every_token_just_finishes(tokenizer: Tokenizer,
                                                           script: list[int]) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers(script, {"a": (6, "no finish")})
    deltas = await collect(make_pipeline(tokenizer, router, workers), request(6))
    assert workers.calls == ["a"] and router.excluded == [()]
    assert joined(deltas) == (tokenizer.decode(script[:6]), script[:6])
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert deltas[-1].usage == Usage(len(PROMPT), 6, 2)


@pytest.mark.parametrize("reported_as_failure", [False, True])
async def test_a_cancelled_request_is_never_reissued(tokenizer: Tokenizer, script: list[int],
                                                     reported_as_failure: bool) -> None:
    router = ScriptedRouter()
    breaks = {"a": (99, "died")} if reported_as_failure else {}
    workers = ScriptedWorkers(script, breaks, hangs={"a": 4})
    received: list[int] = []

    async def consume() -> None:
        async for delta in make_pipeline(tokenizer, router, workers).generate(request()):
            received.extend(delta.token_ids)

    task = asyncio.create_task(consume())
    while len(received) < 4:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises((asyncio.CancelledError, Unavailable)):
        await task
    assert workers.cancelled.is_set()
    assert workers.calls == ["a"] and router.excluded == [()]
    assert router.completed[0][0] in ("cancelled", "error")


async def test_a_closed_stream_is_never_reissued(tokenizer: Tokenizer, script: list[int]) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers(script, hangs={"a": 4})
    gen = make_pipeline(tokenizer, router, workers).generate(request())
    await anext(gen)
    await gen.aclose()  # the client left
    assert workers.calls == ["a"] and router.completed == [("cancelled", 2)]


async def test_a_disaggregated_request_migrates_aggregated(tokenizer: Tokenizer,
                                                           script: list[int]) -> None:
    router, prefill = ScriptedRouter(prefill=True), ScriptedPrefill(set())
    # The prefill worker's first token is the script's first (the scripted prefill answers 0).
    script = [0, *script[1:]]
    workers = ScriptedWorkers(script, {"a": (4, "died")})
    deltas = await collect(make_pipeline(tokenizer, router, workers, prefill=prefill), request())
    assert joined(deltas)[1] == script[:10]
    (_, first), (_, resumed) = workers.requests
    assert first.kv_handle is not None and first.first_token is not None
    assert resumed.kv_handle is None and resumed.first_token is None
    # The first decode worker consumed the lease; nothing to release. The prefill worker's
    # cache hits are the client's.
    assert prefill.calls == ["p1"] and prefill.released == []
    assert deltas[-1].usage == Usage(len(PROMPT), 10, 1)


async def test_a_lease_the_failed_worker_may_not_have_read_is_released(
        tokenizer: Tokenizer, script: list[int]) -> None:
    router, prefill = ScriptedRouter(prefill=True), ScriptedPrefill(set())
    workers = ScriptedWorkers([0, *script[1:]], {"a": (0, "internal")})
    deltas = await collect(make_pipeline(tokenizer, router, workers, prefill=prefill), request())
    assert workers.calls == ["a", "b"] and len(joined(deltas)[1]) == 10
    assert workers.requests[1][1].kv_handle is None
    assert [h.request_id for h in prefill.released] == ["r1"]


async def test_a_failed_prefill_worker_is_skipped_then_the_request_served_aggregated(
        tokenizer: Tokenizer, script: list[int]) -> None:
    script = [0, *script[1:]]
    prefill = ScriptedPrefill({"p1"})
    workers = ScriptedWorkers(script)
    deltas = await collect(make_pipeline(tokenizer, ScriptedRouter(prefill=True), workers,
                                         prefill=prefill), request())
    assert prefill.calls == ["p1", "p2"]
    assert workers.requests[0][1].kv_handle is not None
    assert joined(deltas)[1] == script[:10]

    prefill = ScriptedPrefill({"p1", "p2"})
    workers = ScriptedWorkers(script)
    deltas = await collect(make_pipeline(tokenizer, ScriptedRouter(prefill=True), workers,
                                         prefill=prefill), request())
    assert prefill.calls == ["p1", "p2"]
    assert workers.requests[0][1].kv_handle is None  # aggregated: the decode worker prefills
    assert joined(deltas)[1] == script[:10]
    assert deltas[-1].usage == Usage(len(PROMPT), 10, 3)  # the decode worker's cache hits


async def test_a_constrained_request_counts_the_carried_tokens_as_output(
        tokenizer: Tokenizer, script: list[int]) -> None:
    # Each continuation tells the worker how many trailing prompt tokens are output already
    # generated under the grammar, so that it advances the matcher over exactly those.
    guided = GuidedDecoding(GuidedKind.REGEX, "[a-z ]+")
    req = dataclasses.replace(request(12), sampling=SamplingParams(max_tokens=12, guided=guided))
    workers = ScriptedWorkers(script, {"a": (2, "died"), "b": (4, "internal")})
    await collect(make_pipeline(tokenizer, ScriptedRouter(), workers), req)
    sent = [r.sampling.guided for _, r in workers.requests]
    assert [g.num_output_tokens_in_prompt for g in sent if g is not None] == [0, 2, 6]
    assert all(g is not None and g.grammar_key == guided.grammar_key for g in sent)
