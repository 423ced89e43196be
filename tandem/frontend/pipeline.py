"""The frontend's data path for one request: route -> encode the images on an encode worker when
the router names one -> prefill on a prefill worker when the router disaggregates -> stream
tokens from a decode worker (which reads the prefill worker's KV) -> detokenize (stop strings
included) -> deltas for the client -> release the router's load. A decode stream that breaks
midway migrates to another decode worker (see Pipeline._decode).

Backend- and transport-blind: the router and worker clients are injected (tandem.runtime.clients
in production), so this module has no grpc import.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from tandem.engines.types import (
    Embedding,
    EngineRequest,
    FinishReason,
    KvHandle,
    PrefillResult,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
    Usage,
)
from tandem.errors import DeadlineExceeded, Overloaded, Unavailable, UpstreamError
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.metrics import FrontendMetrics, QueuedPrompt
from tandem.frontend.prefill_gate import PrefillGate
from tandem.multimodal.prompt import place_embeddings
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef
from tandem.runtime import tracing

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
    #: The prompt's images at their placeholder tokens, not yet encoded (see
    #: tandem.multimodal.prompt); replaced by their embeddings once an encode worker ran.
    embeddings: tuple[Embedding, ...] = ()
    #: With images: the prompt's block hashes, images included, for the router's prefix
    #: matching (it cannot compute them from the token ids alone).
    block_hashes: tuple[int, ...] = ()
    #: Workers the router should pick when they are candidates (by worker_id): where another
    #: choice of the same prompt computed its KV (tandem.frontend.choices).
    prefer_workers: tuple[str, ...] = ()

    def engine_request(self, kv_handle: KvHandle | None = None,
                       first_token: TokenLogprob | None = None) -> EngineRequest:
        """What a prefill or decode worker gets (a decode worker resuming: with the handle)."""
        return EngineRequest(self.request_id, tuple(self.prompt_token_ids), self.sampling,
                             kv_handle, first_token, self.embeddings)

    def continued(self, token_ids: Sequence[int]) -> GenerationRequest:
        """The request as another decode worker resumes it after `token_ids` were generated
        (migration): those tokens appended to the prompt, `max_tokens` and `min_tokens` reduced
        by them. Prompt logprobs, if asked, belonged to the original prompt and are not asked
        again. The embeddings stay at their placeholders, which the appended tokens do not move.
        A structured-output constraint counts the appended tokens as output already generated.
        """
        num = len(token_ids)
        guided = self.sampling.guided
        if guided is not None:  # the worker advances the grammar over the appended tokens
            guided = dataclasses.replace(
                guided, num_output_tokens_in_prompt=guided.num_output_tokens_in_prompt + num)
        sampling = dataclasses.replace(self.sampling, max_tokens=self.sampling.max_tokens - num,
                                       min_tokens=max(self.sampling.min_tokens - num, 0),
                                       prompt_logprobs=None, guided=guided)
        return dataclasses.replace(self, prompt_token_ids=[*self.prompt_token_ids, *token_ids],
                                   sampling=sampling)

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
    #: TokenChunk.received_ns of the chunk this delta came from (0: not measured).
    received_ns: int = 0
    #: Which of the request's `n` choices this delta belongs to (tandem.frontend.choices).
    index: int = 0
    #: The prefill worker that computed the prompt, when disaggregated.
    prefill_worker: WorkerRef | None = None
    #: The stop string that ended the answer (finish_reason STOP by a stop string); None
    #: otherwise (end of sequence, a stop token, the length).
    stop_string: str | None = None


class RouterPort(Protocol):
    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision: ...

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        """Queues the release of a request's load; never blocks the caller."""
        ...


class DecodePort(Protocol):
    def generate(self, address: str, request: EngineRequest,
                 timeout_s: float | None = None) -> AsyncGenerator[TokenChunk, None]: ...


class PrefillPort(Protocol):
    async def prefill(self, address: str, request: EngineRequest,
                      timeout_s: float | None = None) -> PrefillResult: ...

    def release(self, handle: KvHandle) -> None:
        """Frees a lease in the background; never blocks the caller."""
        ...


class EncodePort(Protocol):
    async def encode(self, address: str, request_id: str, images: Sequence[Embedding],
                     timeout_s: float | None = None) -> list[Embedding]:
        """The embeddings of `images` (items not yet encoded), in order."""
        ...


#: Workers a request may be refused by before it fails (each refusal re-asks the router).
MAX_FALLBACKS = 3

DetokenizerFactory = Callable[[GenerationRequest], IncrementalDetokenizer]


@dataclass(slots=True)
class _Progress:
    """One request's output so far; it carries over from one decode worker to the next, so the
    client sees one stream however many workers produced it."""

    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    #: perf_counter() of the request's start (TTFT) and of its last chunk (inter-token latency).
    start: float
    last_chunk_at: float
    #: Every output token received so far, from every worker.
    token_ids: list[int] = field(default_factory=list)
    #: The client's prompt tokens served from a prefix cache (first worker, or prefill worker).
    cached_tokens: int = 0
    #: Speculative decoding's drafted tokens accepted / rejected, summed over the workers that
    #: reported them: a worker reports on its last chunk only, so a worker whose stream broke
    #: (before a migration) or that a stop string cut short adds nothing.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    num_migrations: int = 0
    #: Whether the current worker has sent anything (before that, a failure is a refusal).
    worker_streamed: bool = False

    def add_predictions(self, usage: Usage) -> None:
        """Counts a worker's final usage's speculative tokens in."""
        self.accepted_prediction_tokens += usage.accepted_prediction_tokens
        self.rejected_prediction_tokens += usage.rejected_prediction_tokens

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, len(self.token_ids), self.cached_tokens,
                     self.accepted_prediction_tokens, self.rejected_prediction_tokens)


def _is_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Pipeline:
    def __init__(self, router: RouterPort, decode: DecodePort,
                 new_detokenizer: DetokenizerFactory, metrics: FrontendMetrics,
                 prefill: PrefillPort | None = None, encode: EncodePort | None = None,
                 migration_limit: int = 0, prefill_gate: PrefillGate | None = None) -> None:
        self.router = router
        self.decode = decode
        self.prefill = prefill
        self.encode = encode
        self.new_detokenizer = new_detokenizer
        self.metrics = metrics
        #: Times a request may move to another decode worker after its stream broke; 0: never.
        self.migration_limit = migration_limit
        #: Late binding of prompts to prefill workers; None: the router's pick at once.
        self.prefill_gate = prefill_gate

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
        """Streams the answer. Closing the iterator early cancels the request downstream."""
        outcome, produced = "error", 0
        start = time.perf_counter()  # TTFT counts routing and prefill too
        queued = self.metrics.arrive(len(req.prompt_token_ids))
        try:
            # Inside the try: a client gone during Route must still release what it counted.
            decision = await self._route(req)
            if req.embeddings and decision.encode_workers:
                req = dataclasses.replace(req, embeddings=await self._encode(req, decision))
            async with aclosing(self._stream(req, decision, start, queued)) as deltas:
                async for delta in deltas:
                    queued.answered()
                    produced += len(delta.token_ids)
                    if delta.usage is not None:  # on the request's span (the consumer's)
                        tracing.annotate({tracing.INPUT_TOKENS: delta.usage.prompt_tokens,
                                          tracing.OUTPUT_TOKENS: delta.usage.completion_tokens})
                    yield delta
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            queued.answered()
            self.router.report_completion(req.request_id, outcome, produced)

    async def _route(self, req: GenerationRequest,
                     exclude_ids: tuple[str, ...] = ()) -> RouteDecision:
        return await self.router.route(req.request_id, req.prompt_token_ids,
                                       req.sampling.max_tokens, req.sla, exclude_ids=exclude_ids,
                                       timeout_s=req.remaining_s(),
                                       block_hashes=req.block_hashes,
                                       has_images=bool(req.embeddings),
                                       prefer_ids=req.prefer_workers)

    async def _encode(self, req: GenerationRequest,
                      decision: RouteDecision) -> tuple[Embedding, ...]:
        """The images' embeddings from the first encode worker that answers; the images
        themselves when none can (the prefill or decode worker then encodes them)."""
        if self.encode is None:
            return req.embeddings
        for worker in decision.encode_workers:
            try:
                encoded = await self.encode.encode(worker.address, req.request_id,
                                                   req.embeddings, req.remaining_s())
                return place_embeddings(req.embeddings, encoded)
            except (Unavailable, Overloaded, UpstreamError) as exc:
                log.warning("encode worker failed, trying the next", extra={
                    "worker": worker.worker_id, "error": exc.message})
        log.warning("no encode worker answered; the images go to the prefill/decode worker",
                    extra={"request_id": req.request_id})
        return req.embeddings

    async def _stream(self, req: GenerationRequest, decision: RouteDecision, start: float,
                      queued: QueuedPrompt) -> AsyncGenerator[Delta, None]:
        """Prefills when the router disaggregates, then streams from the decode pick. The
        prompt stops waiting once prefilled (its first token made), not once the decode worker
        streams it: what waits for decode is no prefill work. With a prefill gate the prompt
        may first wait for a prefill worker with room (and be routed again meanwhile)."""
        answered = None
        if decision.disaggregate and self.prefill_gate is not None:
            gate, num_tokens = self.prefill_gate, len(req.prompt_token_ids)
            with self.metrics.waiting_for_prefill_room():
                decision, gated = await gate.admit(num_tokens, decision,
                                                   lambda: self._route(req), req.remaining_s())
            try:
                answered = await self._prefill(req, decision) if gated is not None else None
            finally:
                if gated is not None:
                    gate.release(gated, num_tokens)
        elif decision.disaggregate:
            answered = await self._prefill(req, decision)
        if answered is not None:
            queued.answered()
        prefilled, prefill_worker = answered or (None, None)
        if prefilled is not None and prefilled.kv_handle is None:
            delta = self._answered_by_prefill(req, prefilled, decision.prefill_workers[0])
            delta.prefill_worker = prefill_worker
            self.metrics.observe_chunk(time.perf_counter() - start, 0.0, len(delta.token_ids))
            yield delta
            return
        started = False
        try:
            async with aclosing(self._decode(req, decision, prefilled, start)) as deltas:
                async for delta in deltas:
                    if not started:
                        delta.prefill_worker = prefill_worker
                    started = True
                    yield delta
        finally:
            if prefilled is not None and prefilled.kv_handle is not None and not started:
                # No decode worker took the KV: free it now rather than at lease expiry.
                assert self.prefill is not None
                self.prefill.release(prefilled.kv_handle)

    async def _prefill(self, req: GenerationRequest, decision: RouteDecision
                       ) -> tuple[PrefillResult, WorkerRef] | None:
        """The first token and KV handle from the first prefill worker that answers, and that
        worker; None when none can (the decode worker then prefills the prompt itself)."""
        if self.prefill is None:
            return None
        engine_req = req.engine_request()
        for worker in decision.prefill_workers:
            try:
                return (await self.prefill.prefill(worker.address, engine_req, req.remaining_s()),
                        worker)
            except (Unavailable, Overloaded, UpstreamError) as exc:
                log.warning("prefill worker failed, trying the next", extra={
                    "worker": worker.worker_id, "error": exc.message})
        log.warning("no prefill worker answered; serving the request aggregated",
                    extra={"request_id": req.request_id})
        return None

    def _answered_by_prefill(self, req: GenerationRequest, prefilled: PrefillResult,
                             worker: WorkerRef) -> Delta:
        """The request finished on its first token (EOS, a stop token): no decode leg."""
        detok = self.new_detokenizer(req)
        token = prefilled.first_token
        text = detok.add([token.token_id])
        text += "" if detok.stopped else detok.finish()
        kept = [token.token_id] if detok.num_tokens else []
        logprobs = [token] if kept and req.sampling.top_logprobs is not None else []
        finish = FinishReason.STOP if detok.stopped else prefilled.finish_reason
        usage = Usage(len(req.prompt_token_ids), len(kept), prefilled.cached_tokens)
        return Delta(text, kept, logprobs, finish, usage, worker, stop_string=detok.matched_stop)

    async def _decode(self, req: GenerationRequest, decision: RouteDecision,
                      prefilled: PrefillResult | None,
                      start: float) -> AsyncGenerator[Delta, None]:
        """Streams from the router's pick, moving to another decode worker when this one fails.

        A worker that refuses before it sent anything (unavailable, overloaded) is excluded and
        the router asked again, so that the request's load moves to the worker that really
        serves it (at most MAX_FALLBACKS times). A worker whose stream breaks (it died:
        Unavailable; the stream failed or ended unfinished: UpstreamError) is excluded too and
        the request migrates (at most `migration_limit` times): the router's next pick gets it
        with the tokens so far appended to the prompt (GenerationRequest.continued) and
        aggregated, since the KV handle was the first worker's to consume. The detokenizer and
        the counts carry over. Only the consumer closing this generator (the client left) or
        cancelling its task ends it early, and then nothing is re-issued.
        """
        progress = _Progress(self.new_detokenizer(req), len(req.prompt_token_ids), start, start)
        attempt, num_refusals = req, 0
        excluded: list[str] = []
        while True:
            if not decision.decode_workers:
                raise Unavailable("router returned no decode worker")
            worker = decision.decode_workers[0]
            progress.worker_streamed = False
            try:
                async with aclosing(self._from_worker(attempt, worker, prefilled,
                                                      progress)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except (Unavailable, Overloaded, UpstreamError) as exc:
                failure = exc
                if _is_cancelling():
                    raise  # the client left as the stream broke: never re-issue for it
                if not progress.worker_streamed and not isinstance(exc, UpstreamError):
                    if num_refusals >= MAX_FALLBACKS:
                        raise
                    num_refusals += 1
                    self.metrics.refusals.labels(self.metrics.model).inc()
                    log.warning("decode worker refused the request, asking the router again",
                                extra={"worker": worker.worker_id, "error": exc.message})
                elif (isinstance(exc, Overloaded)
                      or progress.num_migrations >= self.migration_limit):
                    raise
                else:
                    progress.num_migrations += 1
                    self.metrics.migrations.labels(self.metrics.model).inc()
                    if prefilled is not None and prefilled.kv_handle is not None:
                        if not progress.worker_streamed and self.prefill is not None:
                            # It may never have read the KV; a consumed lease ignores this.
                            self.prefill.release(prefilled.kv_handle)
                        prefilled = None
                    attempt = req.continued(progress.token_ids)
                    log.warning("decode stream broke; migrating the request", extra={
                        "request_id": req.request_id, "worker": worker.worker_id,
                        "error": exc.message, "generated_tokens": len(progress.token_ids),
                        "migration": progress.num_migrations})
            excluded.append(worker.worker_id)
            if attempt.sampling.max_tokens <= 0:
                # Every token came before the stream broke; only the finish was missing.
                yield Delta(progress.detokenizer.finish(), [], [], FinishReason.LENGTH,
                            progress.usage(), worker)
                return
            try:
                decision = await self._route(attempt, tuple(excluded))
            except Unavailable:
                # Nobody else can take it: the client hears the worker's failure itself (an
                # overloaded deployment answers 429 with Retry-After, not 503).
                raise failure from None

    async def _from_worker(self, req: GenerationRequest, worker: WorkerRef,
                           prefilled: PrefillResult | None,
                           progress: _Progress) -> AsyncGenerator[Delta, None]:
        detok = progress.detokenizer
        engine_req = req.engine_request()
        if prefilled is not None:
            # The embeddings go along: the decode worker hashes its blocks with them, and needs
            # them to recompute the prompt if the KV read fails.
            engine_req = req.engine_request(kv_handle=prefilled.kv_handle,
                                            first_token=prefilled.first_token)
            # Disaggregated, the prefill worker's cache hits are the request's.
            progress.cached_tokens = prefilled.cached_tokens
        # After a migration the worker's cache hits cover generated tokens, not the client's.
        own_cache = prefilled is None and progress.num_migrations == 0
        chunks = self.decode.generate(worker.address, engine_req, req.remaining_s())
        try:
            async for chunk in chunks:
                progress.worker_streamed = True
                now = time.perf_counter()
                self.metrics.observe_chunk(None if progress.token_ids else now - progress.start,
                                           now - progress.last_chunk_at, len(chunk.token_ids))
                progress.last_chunk_at = now
                if chunk.cached_tokens is not None and own_cache:
                    progress.cached_tokens = chunk.cached_tokens
                num_before = len(progress.token_ids)
                text = detok.add(chunk.token_ids)
                if detok.stopped:
                    # A stop string ended the answer: keep the tokens up to it, drop the rest.
                    kept = chunk.token_ids[:max(detok.num_tokens - num_before, 0)]
                    progress.token_ids.extend(kept)
                    yield Delta(text, kept, chunk.logprobs[:len(kept)], FinishReason.STOP,
                                progress.usage(), worker, chunk.received_ns,
                                stop_string=detok.matched_stop)
                    return
                progress.token_ids.extend(chunk.token_ids)
                if chunk.finish_reason is None:
                    if text or chunk.token_ids:
                        yield Delta(text, chunk.token_ids, chunk.logprobs, worker=worker,
                                    received_ns=chunk.received_ns)
                    continue
                if chunk.usage is not None:
                    progress.add_predictions(chunk.usage)
                    if own_cache:
                        progress.cached_tokens = chunk.usage.cached_tokens
                yield Delta(text + detok.finish(), chunk.token_ids, chunk.logprobs,
                            chunk.finish_reason, progress.usage(), worker, chunk.received_ns)
                return
            raise UpstreamError(f"decode worker {worker.address} ended the stream unfinished")
        finally:
            await chunks.aclose()
