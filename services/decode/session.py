"""A decode worker's side of one Decode.Session stream: many requests, one batch per step.

Each request is an engine RequestStream like a Generate call's, but nothing iterates it: the
stream tells the session when it has news (RequestStream.listen), the session notes the request,
and its writer takes every noted request's tokens into one SessionBatch. The engine applies a
step's tokens to all its requests in one go, so a step becomes one message on the wire however
many requests it advanced; a slow reader gets fewer, larger batches.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace import Status as SpanStatus
from opentelemetry.trace import StatusCode as SpanStatusCode

from tandem.engines.base import Engine
from tandem.engines.stream import RequestStream
from tandem.engines.types import EngineRequest, TokenChunk
from tandem.errors import InvalidRequest, TandemError, Unavailable
from tandem.runtime import logs, status, tracing
from tandem.runtime.draining import Draining
from tandem.v1 import decode_pb2 as pb

log = logging.getLogger(__name__)
_SPAN_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": "tandem.v1.Decode",
                    "rpc.method": "Generate", "tandem.session": True}


@dataclass(slots=True)
class _Running:
    stream: RequestStream
    #: The request's server span (tracing.start_span; the no-op span when tracing is off).
    span: Span
    #: No token sent yet (the span gets a `first_token` event with the first, when traced).
    before_first: bool = True


def _error(exc: BaseException, request_id: str) -> pb.RequestError:
    if isinstance(exc, TandemError):
        return pb.RequestError(code=status.code_for(exc).value[0],
                               message=status.details_for(exc))
    log.error("unhandled error in a session request", exc_info=exc,
              extra={"request_id": request_id})
    return pb.RequestError(code=grpc.StatusCode.INTERNAL.value[0],
                           message="internal error (see the service's log)")


class WorkerSession:
    def __init__(self, engine: Engine, draining: Draining,
                 to_engine_request: Callable[[pb.GenerateRequest], EngineRequest],
                 fill_chunk: Callable[[pb.GenerateChunk, TokenChunk], None],
                 min_interval_s: float = 0.0) -> None:
        self.engine = engine
        #: A batch goes out at most this long after the previous one (news meanwhile waits).
        self.min_interval_s = min_interval_s
        self.draining = draining
        self._to_engine_request = to_engine_request
        self._fill_chunk = fill_chunk
        self._running: dict[str, _Running] = {}
        #: Requests with tokens to take, in the order their news came.
        self._news: dict[str, RequestStream] = {}
        #: Requests refused at the start, to send in the next batch.
        self._refused: list[pb.SessionChunk] = []
        self._wake = asyncio.Event()
        #: time.time_ns() of the oldest news not yet sent (0: none).
        self._news_since_ns = 0
        #: The caller sent its last request (half-close) or the call ended.
        self._requests_done = False
        self._traced = tracing.is_enabled()

    @contextlib.asynccontextmanager
    async def reading(self, requests: AsyncIterator[pb.SessionRequest]) -> AsyncIterator[None]:
        """Reads the caller's requests in the background; on the way out (session over, caller
        gone, worker stopping) every request still running is aborted."""
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            yield
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            for request_id in list(self._running):
                self._cancel(request_id)

    async def batches(self) -> AsyncIterator[pb.SessionBatch]:
        """One batch per wake-up with every request's news; ends once the caller sent its last
        request and nothing is running."""
        loop = asyncio.get_running_loop()
        next_at = 0.0
        while True:
            if not self._news and not self._refused:
                if self._requests_done and not self._running:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            wait = next_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            next_at = loop.time() + self.min_interval_s
            news, self._news = self._news, {}
            batch = pb.SessionBatch(chunks=self._refused, produced_unix_ns=self._news_since_ns)
            self._news_since_ns = 0
            self._refused = []
            for request_id, stream in news.items():
                self._take(request_id, stream, batch.chunks.add(request_id=request_id))
            batch.sent_unix_ns = time.time_ns()
            yield batch

    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for message in requests:
                action = message.WhichOneof("action")
                if action == "generate":
                    self._start(message)
                elif action == "cancel_request_id":
                    self._cancel(message.cancel_request_id)
        finally:
            self._requests_done = True
            self._wake.set()

    def _start(self, message: pb.SessionRequest) -> None:
        request_id = message.generate.request_id
        parent = tracing.extract(message.trace_context) if message.trace_context else None
        span = tracing.start_span("tandem.v1.Decode/Generate", SpanKind.SERVER,
                                  _SPAN_ATTRIBUTES, parent)
        token = logs.request_id_var.set(request_id)
        try:
            if self.draining.active:
                raise Unavailable("decode worker is draining")
            if not request_id:
                raise InvalidRequest("request_id must not be empty", param="request_id")
            if request_id in self._running:
                raise InvalidRequest(f"request {request_id} is already running in this session",
                                     param="request_id")
            engine_request = self._to_engine_request(message.generate)
            with tracing.in_span(span):  # the engine keeps this context for the KV read's span
                stream = self.engine.add_request(engine_request)
        except Exception as exc:  # noqa: BLE001 - the request's error, sent in its chunk
            self._refused.append(pb.SessionChunk(request_id=request_id,
                                                 error=_error(exc, request_id)))
            self._wake.set()
            _end_span(span, exc)
            return
        finally:
            logs.request_id_var.reset(token)
        self.draining.enter()
        self._running[request_id] = _Running(stream, span)
        stream.listen(self._on_news)

    def _on_news(self, stream: RequestStream) -> None:
        if stream.request_id in self._running:
            if not self._news_since_ns:
                self._news_since_ns = time.time_ns()
            self._news[stream.request_id] = stream
            self._wake.set()

    def _take(self, request_id: str, stream: RequestStream, item: pb.SessionChunk) -> None:
        """Fills `item` (in the batch being built) with the request's news."""
        try:
            chunk = stream.take()
        except Exception as exc:  # noqa: BLE001 - the engine failed the request
            self._end(request_id, exc)
            item.error.CopyFrom(_error(exc, request_id))
            return
        if self._traced and chunk.token_ids:
            running = self._running.get(request_id)
            if running is not None and running.before_first:
                running.before_first = False
                running.span.add_event("first_token")  # where TTFT goes, in the trace
        if chunk.finish_reason is not None:
            running = self._running.get(request_id)
            if running is not None and chunk.usage is not None:
                running.span.set_attributes({
                    tracing.INPUT_TOKENS: chunk.usage.prompt_tokens,
                    tracing.OUTPUT_TOKENS: chunk.usage.completion_tokens})
            self._end(request_id, None)
        self._fill_chunk(item.chunk, chunk)

    def _cancel(self, request_id: str) -> None:
        """The caller stopped reading this request: its blocks go back now."""
        running = self._running.get(request_id)
        if running is None:
            return  # finished already, or never started
        self._news.pop(request_id, None)
        running.span.set_attribute("tandem.cancelled", True)
        self._end(request_id, None)
        self.engine.abort(request_id)

    def _end(self, request_id: str, error: BaseException | None) -> None:
        running = self._running.pop(request_id, None)
        if running is None:
            return
        _end_span(running.span, error)
        self.draining.leave()


def _end_span(span: Span, error: BaseException | None) -> None:
    if error is not None:
        span.record_exception(error)
        span.set_status(SpanStatus(SpanStatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()
