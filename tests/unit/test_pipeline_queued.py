"""The frontend pipeline's account of what waits to be prefilled (the planner's arrivals and
waiting floors): a generation counts as it arrives and waits until its first token is made
(by the decode worker, or by the prefill worker when disaggregated), and every way out of the
pipeline takes it out. Router, prefill and decode workers are scripted stand-ins for the ports
(tests/unit/test_pipeline_fallback.py's); the pipeline and metrics are the real ones."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

import pytest

from tandem.engines.types import EngineRequest, PrefillResult, SamplingParams, TokenLogprob
from tandem.errors import Unavailable
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.pipeline import GenerationRequest, Pipeline
from tandem.frontend.tokenizer import Tokenizer
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef
from tests.unit.test_pipeline_fallback import WORKERS, ScriptedRouter, ScriptedWorkers, tokenizer

__all__ = ["tokenizer"]  # the fixture, shared
REQ = GenerationRequest("r1", [10, 11, 12], SamplingParams(max_tokens=2))


def sample(metrics: FrontendMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": "m"})


def waiting(metrics: FrontendMetrics) -> tuple[float | None, float | None]:
    return (sample(metrics, "tandem_frontend_queued_generations"),
            sample(metrics, "tandem_frontend_queued_prompt_tokens"))


class Watching(ScriptedRouter):
    """Records what waits when it is asked to route; `block` holds every route until set."""

    def __init__(self, metrics: FrontendMetrics, block: asyncio.Event | None = None,
                 refuse: bool = False) -> None:
        super().__init__()
        self.metrics, self.block, self.refuse = metrics, block, refuse
        self.seen: list[tuple[float | None, float | None]] = []

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision:
        self.seen.append(waiting(self.metrics))
        if self.block is not None:
            await self.block.wait()
        if self.refuse:
            raise Unavailable("no worker")
        return await super().route(request_id, token_ids, expected_osl, sla, exclude_ids)


def pipeline(tokenizer: Tokenizer, router: ScriptedRouter, workers: ScriptedWorkers,
             metrics: FrontendMetrics, prefill: object = None) -> Pipeline:
    return Pipeline(router, workers, lambda req: IncrementalDetokenizer(tokenizer), metrics,
                    prefill=prefill)  # type: ignore[arg-type]


async def test_a_generation_waits_from_its_arrival_to_its_first_token(
        tokenizer: Tokenizer) -> None:
    metrics = FrontendMetrics("m")
    router = Watching(metrics)
    served = pipeline(tokenizer, router, ScriptedWorkers({}), metrics)
    seen_at_first = []
    async for _ in served.generate(REQ):
        seen_at_first.append(waiting(metrics))
    assert router.seen == [(1, 3)]  # counted before it is routed
    assert seen_at_first[0] == (0, 0)  # its first token: no longer waiting
    assert sample(metrics, "tandem_frontend_arrivals_total") == 1
    assert sample(metrics, "tandem_frontend_arrival_prompt_tokens_total") == 3


@pytest.mark.parametrize("way_out", ["no worker routed", "every worker refused",
                                     "cancelled while routing"])
async def test_every_way_out_stops_it_waiting(tokenizer: Tokenizer, way_out: str) -> None:
    metrics = FrontendMetrics("m")
    block = asyncio.Event() if way_out == "cancelled while routing" else None
    router = Watching(metrics, block, refuse=way_out == "no worker routed")
    refuse = {w.address: Unavailable("down") for w in WORKERS} \
        if way_out == "every worker refused" else {}
    served = pipeline(tokenizer, router, ScriptedWorkers(refuse), metrics)

    async def run() -> None:
        async for _ in served.generate(REQ):
            pass

    task = asyncio.create_task(run())
    while not router.seen:
        await asyncio.sleep(0)
    assert router.seen[0] == (1, 3)  # waiting while it was routed
    if block is not None:
        task.cancel()
    with pytest.raises((Unavailable, asyncio.CancelledError)):
        await task
    assert waiting(metrics) == (0, 0)


class Prefilled:
    """A prefill worker that answers with a first token and a KV handle (a stand-in: the
    scripted decode worker never reads it), recording what waits when it answers."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics
        self.seen: list[tuple[float | None, float | None]] = []

    async def prefill(self, address: str, request: EngineRequest,
                      timeout_s: float | None = None) -> PrefillResult:
        self.seen.append(waiting(self.metrics))
        return PrefillResult(TokenLogprob(300, 0.0), object(), 0)  # type: ignore[arg-type]

    def release(self, handle: object) -> None:
        pass


class DisaggRouter(ScriptedRouter):
    async def route(self, *args: object, **kwargs: object) -> RouteDecision:
        return RouteDecision(tuple(WORKERS[:1]), disaggregate=True,
                             prefill_workers=(WorkerRef("p", "p", "prefill"),))


class WatchingDecode(ScriptedWorkers):
    def __init__(self, metrics: FrontendMetrics) -> None:
        super().__init__({})
        self.metrics = metrics
        self.seen: list[tuple[float | None, float | None]] = []

    async def generate(self, address: str, request: EngineRequest,
                       timeout_s: float | None = None) -> AsyncGenerator:  # type: ignore[type-arg]
        self.seen.append(waiting(self.metrics))
        async for chunk in super().generate(address, request, timeout_s):
            yield chunk


async def test_disaggregated_it_stops_waiting_once_prefilled(tokenizer: Tokenizer) -> None:
    """What waits for a decode worker is no prefill work: the prefill floor must not count it."""
    metrics = FrontendMetrics("m")
    prefill, decode = Prefilled(metrics), WatchingDecode(metrics)
    served = pipeline(tokenizer, DisaggRouter(), decode, metrics, prefill)
    tokens = [t async for d in served.generate(REQ) for t in d.token_ids]
    assert tokens  # served
    assert prefill.seen == [(1, 3)] and decode.seen == [(0, 0)]
    assert waiting(metrics) == (0, 0)
