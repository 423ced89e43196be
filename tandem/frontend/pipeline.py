"""The frontend's data path for one request: route -> stream tokens from a decode worker ->
detokenize (stop strings included) -> deltas for the client -> release the router's load.

Backend- and transport-blind: the router and worker clients are injected (tandem.runtime.clients
in production), so this module has no grpc import.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from tandem.engines.types import (
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
    Usage,
)
from tandem.errors import DeadlineExceeded, Overloaded, Unavailable, UpstreamError
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.metrics import FrontendMetrics
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    #: Tandem's own id (unique), used by the router and the engine; never the client's.
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    sla: SlaHints = field(default_factory=SlaHints)
    #: time.monotonic() by which the request must be done; None: no deadline.
    deadline: float | None = None

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline. Raises DeadlineExceeded once it has passed."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed")
        return left


@dataclass(slots=True)
class Delta:
    """What one step of the stream adds for the client."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    #: The decode worker producing this answer (its pool too).
    worker: WorkerRef | None = None


class RouterPort(Protocol):
    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None) -> RouteDecision: ...

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        """Queues the release of a request's load; never blocks the caller."""
        ...


class DecodePort(Protocol):
    def generate(self, address: str, request: EngineRequest,
                 timeout_s: float | None = None) -> AsyncGenerator[TokenChunk, None]: ...


#: Workers a request may be refused by before it fails (each refusal re-asks the router).
MAX_FALLBACKS = 3

DetokenizerFactory = Callable[[GenerationRequest], IncrementalDetokenizer]


class Pipeline:
    def __init__(self, router: RouterPort, decode: DecodePort,
                 new_detokenizer: DetokenizerFactory, metrics: FrontendMetrics) -> None:
        self.router = router
        self.decode = decode
        self.new_detokenizer = new_detokenizer
        self.metrics = metrics

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        """Streams the answer. Closing the iterator early cancels the request downstream."""
        outcome, produced = "error", 0
        try:
            # Inside the try: a client gone during Route must still release what it counted.
            decision = await self.router.route(req.request_id, req.prompt_token_ids,
                                               req.sampling.max_tokens, req.sla,
                                               timeout_s=req.remaining_s())
            async with aclosing(self._stream(req, decision)) as deltas:
                async for delta in deltas:
                    produced += len(delta.token_ids)
                    yield delta
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self.router.report_completion(req.request_id, outcome, produced)

    async def _stream(self, req: GenerationRequest,
                      decision: RouteDecision) -> AsyncGenerator[Delta, None]:
        """Streams from the router's pick. A worker that refuses before anything streamed
        (unavailable, overloaded) is excluded and the router asked again, so that the request's
        load moves to the worker that really serves it."""
        refused: list[str] = []
        while True:
            if not decision.decode_workers:
                raise Unavailable("router returned no decode worker")
            worker = decision.decode_workers[0]
            started = False
            try:
                async with aclosing(self._from_worker(req, worker)) as deltas:
                    async for delta in deltas:
                        started = True
                        yield delta
                return
            except (Unavailable, Overloaded) as exc:
                if started or len(refused) >= MAX_FALLBACKS:
                    raise
                refused.append(worker.worker_id)
                refusal = exc
                log.warning("decode worker refused the request, asking the router again",
                            extra={"worker": worker.worker_id, "error": exc.message})
            try:
                decision = await self.router.route(req.request_id, req.prompt_token_ids,
                                                   req.sampling.max_tokens, req.sla,
                                                   exclude_ids=tuple(refused),
                                                   timeout_s=req.remaining_s())
            except Unavailable:
                # Nobody else can take it: the client hears the refusal itself (an overloaded
                # deployment answers 429 with Retry-After, not 503).
                raise refusal from None

    async def _from_worker(self, req: GenerationRequest,
                           worker: WorkerRef) -> AsyncGenerator[Delta, None]:
        detok = self.new_detokenizer(req)
        engine_req = EngineRequest(req.request_id, tuple(req.prompt_token_ids), req.sampling)
        start = last = time.perf_counter()
        emitted = cached = 0
        chunks = self.decode.generate(worker.address, engine_req, req.remaining_s())
        try:
            async for chunk in chunks:
                now = time.perf_counter()
                self.metrics.observe_chunk(now - start if emitted == 0 else None,
                                           now - last, len(chunk.token_ids))
                last = now
                if chunk.cached_tokens is not None:
                    cached = chunk.cached_tokens
                text = detok.add(chunk.token_ids)
                if detok.stopped:
                    # A stop string ended the answer: keep the tokens up to it, drop the rest.
                    kept = chunk.token_ids[:max(detok.num_tokens - emitted, 0)]
                    emitted += len(kept)
                    usage = Usage(len(req.prompt_token_ids), emitted, cached)
                    yield Delta(text, kept, chunk.logprobs[:len(kept)], FinishReason.STOP, usage,
                                worker)
                    return
                emitted += len(chunk.token_ids)
                if chunk.finish_reason is None:
                    if text or chunk.token_ids:
                        yield Delta(text, chunk.token_ids, chunk.logprobs, worker=worker)
                    continue
                if chunk.usage is None:
                    raise UpstreamError(f"decode worker {worker.address} finished without usage")
                usage = Usage(chunk.usage.prompt_tokens, emitted, chunk.usage.cached_tokens)
                yield Delta(text + detok.finish(), chunk.token_ids, chunk.logprobs,
                            chunk.finish_reason, usage, worker)
                return
            raise UpstreamError(f"decode worker {worker.address} ended the stream unfinished")
        finally:
            await chunks.aclose()

