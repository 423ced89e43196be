"""Late binding of prompts to prefill workers (tandem.frontend.prefill_gate): a prompt that finds
no prefill worker with room waits in the frontend, first come first served, and goes to the
first worker that frees room or joins; the deadline and cancellation end a wait cleanly. The
pipeline and gate are the real ones; router and workers scripted stand-ins for the ports
(tests/unit/test_pipeline_fallback.py's)."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tandem.engines.types import EngineRequest, PrefillResult, SamplingParams, TokenLogprob
from tandem.errors import DeadlineExceeded, Unavailable
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.pipeline import GenerationRequest, Pipeline
from tandem.frontend.prefill_gate import PrefillGate
from tandem.frontend.tokenizer import Tokenizer
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef
from tests.unit.test_pipeline_fallback import WORKERS, ScriptedRouter, ScriptedWorkers, tokenizer

__all__ = ["tokenizer"]  # the fixture, shared


def prefill_ref(name: str) -> WorkerRef:
    return WorkerRef(name, name, "prefill")


class PrefillPool(ScriptedRouter):
    """Disaggregates every request over `names`, which the test changes (workers joining)."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = list(names)
        self.disaggregate = True
        self.routes = 0

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision:
        self.routes += 1
        return RouteDecision(tuple(WORKERS[:1]), disaggregate=self.disaggregate,
                             prefill_workers=tuple(prefill_ref(n) for n in self.names))


class HeldPrefill:
    """Prefill workers that answer a request only when the test lets it (`answer`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (request id, worker address)
        self._answers: dict[str, asyncio.Event] = {}

    async def prefill(self, address: str, request: EngineRequest,
                      timeout_s: float | None = None) -> PrefillResult:
        self.calls.append((request.request_id, address))
        event = self._answers.setdefault(request.request_id, asyncio.Event())
        await event.wait()
        return PrefillResult(TokenLogprob(300, 0.0), object(), 0)  # type: ignore[arg-type]

    def answer(self, request_id: str) -> None:
        self._answers.setdefault(request_id, asyncio.Event()).set()

    def release(self, handle: object) -> None:
        pass


async def until(condition: object, what: str) -> None:
    for _ in range(500):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


def gated_pipeline(tokenizer: Tokenizer, router: PrefillPool, prefill: HeldPrefill,
                   gate: PrefillGate) -> Pipeline:
    return Pipeline(router, ScriptedWorkers({}), lambda req: IncrementalDetokenizer(tokenizer),
                    FrontendMetrics("m"), prefill=prefill,  # type: ignore[arg-type]
                    prefill_gate=gate)


def request(i: int, tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(f"r{i}", list(range(10, 10 + tokens)), SamplingParams(max_tokens=2))


async def test_prompts_wait_for_room_and_go_to_the_worker_that_frees_or_joins(
        tokenizer: Tokenizer) -> None:
    router, prefill = PrefillPool("p1"), HeldPrefill()
    gate = PrefillGate(max_tokens=5, recheck_s=0.01)
    served = gated_pipeline(tokenizer, router, prefill, gate)

    async def run(i: int) -> list[int]:
        return [t async for d in served.generate(request(i)) for t in d.token_ids]

    tasks = [asyncio.create_task(run(i)) for i in (1, 2, 3)]
    await until(lambda: prefill.calls == [("r1", "p1")] and gate.num_waiting == 2,
                "r1 sent, r2 and r3 waiting (3 + 3 tokens > 5)")
    assert gate.outstanding("p1") == 3
    router.names.append("p2")  # a worker joins: the head of the line (r2) takes it
    await until(lambda: ("r2", "p2") in prefill.calls, "r2 sent to the new worker")
    assert gate.num_waiting == 1 and ("r3", "p1") not in prefill.calls
    prefill.answer("r1")  # room on p1: r3, waiting behind r2, goes there
    await until(lambda: ("r3", "p1") in prefill.calls, "r3 sent once p1 had room")
    prefill.answer("r2")
    prefill.answer("r3")
    assert all(await asyncio.gather(*tasks))
    assert prefill.calls == [("r1", "p1"), ("r2", "p2"), ("r3", "p1")]
    assert gate.outstanding("p1") == gate.outstanding("p2") == gate.num_waiting == 0


def decision(*names: str) -> RouteDecision:
    return RouteDecision(tuple(WORKERS[:1]), disaggregate=True,
                         prefill_workers=tuple(prefill_ref(n) for n in names))


async def test_a_prompt_longer_than_the_bound_still_fits_an_idle_worker() -> None:
    gate = PrefillGate(max_tokens=5)
    router = PrefillPool("p1", "p2")
    got, worker = await gate.admit(50, decision("p1", "p2"), lambda: router.route(
        "r", [], 1, SlaHints()), None)
    assert worker == prefill_ref("p1") and got.prefill_workers[0] == worker
    # p1 holds 50: the next prompt goes to p2, which the router ranked second.
    got, worker = await gate.admit(3, decision("p1", "p2"), lambda: router.route(
        "r", [], 1, SlaHints()), None)
    assert worker == prefill_ref("p2") and got.prefill_workers == (worker, prefill_ref("p1"))
    assert router.routes == 0  # neither waited, so neither was routed again


async def test_the_deadline_ends_a_wait_with_a_clear_error() -> None:
    gate = PrefillGate(max_tokens=5, recheck_s=0.01)
    router = PrefillPool("p1")
    await gate.admit(5, decision("p1"), lambda: router.route("a", [], 1, SlaHints()), None)
    with pytest.raises(DeadlineExceeded, match="waited for a prefill worker"):
        await gate.admit(3, decision("p1"), lambda: router.route("b", [], 1, SlaHints()), 0.2)
    assert gate.num_waiting == 0 and gate.outstanding("p1") == 5
    assert router.routes > 1  # routed at the head of the line, then again while none freed


async def test_a_failed_routing_ends_the_wait_and_hands_the_turn_on() -> None:
    gate = PrefillGate(max_tokens=5, recheck_s=0.01)
    router = PrefillPool("p1")
    await gate.admit(5, decision("p1"), lambda: router.route("a", [], 1, SlaHints()), None)

    async def refused() -> RouteDecision:
        raise Unavailable("no healthy worker")

    first = asyncio.create_task(gate.admit(3, decision("p1"), refused, None))
    second = asyncio.create_task(gate.admit(2, decision("p1"), lambda: router.route(
        "x", [], 1, SlaHints()), None))
    with pytest.raises(Unavailable):
        await first
    gate.release(prefill_ref("p1"), 5)
    _, worker = await asyncio.wait_for(second, 1.0)
    assert worker == prefill_ref("p1") and gate.num_waiting == 0


async def test_a_prefill_that_fails_or_is_cancelled_gives_its_room_back(
        tokenizer: Tokenizer) -> None:
    router, prefill = PrefillPool("p1"), HeldPrefill()
    gate = PrefillGate(max_tokens=5, recheck_s=0.01)
    served = gated_pipeline(tokenizer, router, prefill, gate)
    task = asyncio.create_task(_collect(served, request(1)))
    await until(lambda: prefill.calls, "r1 prefilling")
    assert gate.outstanding("p1") == 3
    task.cancel()  # the client left while its prompt was prefilled
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.outstanding("p1") == 0


async def test_a_cancelled_wait_leaves_the_line_and_the_next_goes_on() -> None:
    gate = PrefillGate(max_tokens=5, recheck_s=0.01)
    router = PrefillPool("p1")
    await gate.admit(5, decision("p1"), lambda: router.route("a", [], 1, SlaHints()), None)

    def admit(n: int) -> asyncio.Task[tuple[RouteDecision, WorkerRef | None]]:
        return asyncio.create_task(gate.admit(n, decision("p1"), lambda: router.route(
            "x", [], 1, SlaHints()), None))

    first, second = admit(3), admit(2)
    await until(lambda: gate.num_waiting == 2, "both waiting")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.release(prefill_ref("p1"), 5)
    _, worker = await asyncio.wait_for(second, 1.0)
    assert worker == prefill_ref("p1") and gate.outstanding("p1") == 2
    assert gate.num_waiting == 0


async def test_a_wait_routed_back_to_aggregated_serving_takes_no_room(
        tokenizer: Tokenizer) -> None:
    """The router may stop disaggregating a waiting prompt (no prefill worker left, or its
    prefix cached on the decode pick): it is then served without a prefill worker."""
    router, prefill = PrefillPool("p1"), HeldPrefill()
    gate = PrefillGate(max_tokens=5, recheck_s=0.01)
    served = gated_pipeline(tokenizer, router, prefill, gate)
    await gate.admit(5, decision("p1"), lambda: router.route("a", [], 1, SlaHints()), None)
    task = asyncio.create_task(
        asyncio.wait_for(_collect(served, request(9)), 2.0))
    await until(lambda: gate.num_waiting == 1, "r9 waiting")
    router.disaggregate = False
    assert await task  # served by the decode worker alone
    assert prefill.calls == [] and gate.outstanding("p1") == 5


async def _collect(served: Pipeline, req: GenerationRequest) -> list[int]:
    return [t async for d in served.generate(req) for t in d.token_ids]


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        PrefillGate(0)
