"""The frontend pipeline's fallback: a worker that refuses before anything streamed is excluded
and the router asked again (so the router moves the load); a failure after streaming began is
the client's error, never a silent retry. Router and workers are scripted stand-ins for the two
ports; the pipeline, detokenizer and tokenizer are the real ones."""
from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import pytest

from tandem.engines.types import EngineRequest, FinishReason, SamplingParams, TokenChunk, Usage
from tandem.errors import Overloaded, Unavailable
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.pipeline import GenerationRequest, Pipeline
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.demo import ensure_demo_model
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef

WORKERS = [WorkerRef(n, n, "decode") for n in ("a", "b", "c")]


class ScriptedRouter:
    def __init__(self) -> None:
        self.excluded: list[tuple[str, ...]] = []
        self.completed: list[str] = []

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision:
        self.excluded.append(tuple(exclude_ids))
        return RouteDecision(tuple(w for w in WORKERS if w.worker_id not in exclude_ids))

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        self.completed.append(outcome)


class ScriptedWorkers:
    def __init__(self, refuse: dict[str, Exception], fail_midway: set[str] = frozenset()) -> None:
        self.refuse, self.fail_midway, self.calls = refuse, fail_midway, []

    async def generate(self, address: str, request: EngineRequest,
                       timeout_s: float | None = None) -> AsyncGenerator[TokenChunk, None]:
        self.calls.append(address)
        if address in self.refuse:
            raise self.refuse[address]
        yield TokenChunk([300], [])
        if address in self.fail_midway:
            raise Unavailable(f"{address} died")
        yield TokenChunk([301], [], FinishReason.LENGTH, Usage(3, 2))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model())


def pipeline(tokenizer: Tokenizer, router: ScriptedRouter, workers: ScriptedWorkers) -> Pipeline:
    return Pipeline(router, workers, lambda req: IncrementalDetokenizer(tokenizer),
                    FrontendMetrics("m"))


REQ = GenerationRequest("r1", [10, 11, 12], SamplingParams(max_tokens=2))


async def test_refusals_are_excluded_and_the_router_asked_again(tokenizer: Tokenizer) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers({"a": Unavailable("a down"), "b": Overloaded("b full")})
    served = pipeline(tokenizer, router, workers)
    deltas = [d async for d in served.generate(REQ)]
    assert [t for d in deltas for t in d.token_ids] == [300, 301]
    assert served.metrics.registry.get_sample_value("tandem_frontend_worker_refusals_total",
                                                    {"model": "m"}) == 2
    assert workers.calls == ["a", "b", "c"]
    assert router.excluded == [(), ("a",), ("a", "b")]
    assert {d.worker.worker_id for d in deltas} == {"c"}
    assert router.completed == ["ok"]


async def test_failure_after_streaming_began_is_not_retried(tokenizer: Tokenizer) -> None:
    router = ScriptedRouter()
    workers = ScriptedWorkers({}, fail_midway={"a"})
    gen = pipeline(tokenizer, router, workers).generate(REQ)
    first = await anext(gen)
    assert first.token_ids == [300]
    with pytest.raises(Unavailable, match="a died"):
        await anext(gen)
    assert workers.calls == ["a"] and router.excluded == [()]
    assert router.completed == ["error"]


async def test_when_nobody_else_can_take_it_the_refusal_itself_surfaces(
        tokenizer: Tokenizer) -> None:
    class OneWorkerRouter(ScriptedRouter):
        async def route(self, *args, exclude_ids: tuple[str, ...] = (), **kw) -> RouteDecision:
            if exclude_ids:
                raise Unavailable("no healthy worker in any eligible pool")
            return RouteDecision((WORKERS[0],))

    router = OneWorkerRouter()
    gen = pipeline(tokenizer, router, ScriptedWorkers({"a": Overloaded("queue full")})).generate(REQ)
    with pytest.raises(Overloaded, match="queue full"):
        await anext(gen)
