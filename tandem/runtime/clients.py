"""gRPC clients the frontend uses to reach the router and workers. They speak domain types and
raise typed errors, so the request pipeline above them has no grpc import."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import AbstractContextManager, aclosing

import grpc
from opentelemetry.trace import Span, SpanKind

from tandem.engines.types import Embedding, EngineRequest, KvHandle, PrefillResult, TokenChunk
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef
from tandem.runtime import convert, status, tracing
from tandem.runtime.decode_session import BatchObserver, SessionChannel
from tandem.runtime.interceptor import REQUEST_ID_KEY
from tandem.runtime.tls import TlsConfig, aio_channel
from tandem.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    encode_pb2,
    encode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

log = logging.getLogger(__name__)
_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024)]
_OUTCOMES = {"ok": router_pb2.OUTCOME_OK, "error": router_pb2.OUTCOME_ERROR,
             "cancelled": router_pb2.OUTCOME_CANCELLED}


def _ref(msg: router_pb2.WorkerRef) -> WorkerRef:
    return WorkerRef(msg.worker_id, msg.address, msg.pool)


def _client_span(service: str, method: str, address: str) -> AbstractContextManager[Span]:
    """A client span for one call (its context goes out in the metadata: tracing.inject)."""
    return tracing.span(f"tandem.v1.{service}/{method}", SpanKind.CLIENT, {
        "rpc.system": "grpc", "rpc.service": f"tandem.v1.{service}", "rpc.method": method,
        "server.address": address}, current=False)


class RouterClient:
    """Route calls plus batched completion reports.

    Completions ride on the next Route call; if none comes within `flush_ms` they go out in one
    Complete call. Under load that saves an RPC per request on both sides; when idle the router
    learns of a completion at most `flush_ms` late.
    """

    def __init__(self, address: str, flush_ms: float = 20.0, timeout_s: float = 10.0,
                 max_local_prefill_length: int = 0, tls: TlsConfig | None = None) -> None:
        self.address = address
        #: Conditional disaggregation threshold sent with every Route (RouteRequest field).
        self.max_local_prefill_length = max_local_prefill_length
        #: Longest wait for a Route answer when the request itself has no nearer deadline.
        self.timeout_s = timeout_s
        self.flush_s = flush_ms / 1000
        self._channel = aio_channel(address, tls, _OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._pending: list[router_pb2.Completion] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    def _take_pending(self) -> list[router_pb2.Completion]:
        pending, self._pending = self._pending, []
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        return pending

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision:
        completed = self._take_pending()
        request = router_pb2.RouteRequest(
            request_id=request_id, token_ids=token_ids, isl=len(token_ids),
            expected_osl=expected_osl, exclude_worker_ids=exclude_ids, completed=completed,
            max_local_prefill_length=self.max_local_prefill_length,
            block_hashes=block_hashes, has_images=has_images, prefer_worker_ids=prefer_ids)
        if sla.ttft_ms is not None:
            request.sla.ttft_ms = sla.ttft_ms
        if sla.itl_ms is not None:
            request.sla.itl_ms = sla.itl_ms
        if sla.priority is not None:
            request.priority = sla.priority
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        with _client_span("Router", "Route", self.address) as span:
            try:
                reply = await self._stub.Route(request, timeout=timeout, metadata=(
                    (REQUEST_ID_KEY, request_id), *tracing.inject(span)))
            except BaseException as exc:
                # The router may not have read them: report those completions again
                # (idempotent).
                self._requeue(completed)
                if isinstance(exc, grpc.aio.AioRpcError):
                    raise status.from_rpc_error(exc, f"router {self.address}") from None
                raise
        return RouteDecision(decode_workers=tuple(_ref(w) for w in reply.decode_workers),
                             prefill_workers=tuple(_ref(w) for w in reply.prefill_workers),
                             encode_workers=tuple(_ref(w) for w in reply.encode_workers),
                             disaggregate=reply.disaggregate,
                             overlap_blocks=reply.overlap_blocks)

    async def route_video(self, request_id: str, exclude_ids: tuple[str, ...] = ()
                          ) -> tuple[WorkerRef, ...]:
        """Video workers for a video request, best first (RouteRequest.video)."""
        request = router_pb2.RouteRequest(request_id=request_id, video=True,
                                          exclude_worker_ids=exclude_ids,
                                          completed=self._take_pending())
        with _client_span("Router", "Route", self.address) as span:
            try:
                reply = await self._stub.Route(request, timeout=self.timeout_s, metadata=(
                    (REQUEST_ID_KEY, request_id), *tracing.inject(span)))
            except BaseException as exc:
                self._requeue(list(request.completed))
                if isinstance(exc, grpc.aio.AioRpcError):
                    raise status.from_rpc_error(exc, f"router {self.address}") from None
                raise
        return tuple(_ref(w) for w in reply.video_workers)

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        self._requeue([router_pb2.Completion(
            request_id=request_id, outcome=_OUTCOMES[outcome], output_tokens=output_tokens)])

    def _requeue(self, completions: list[router_pb2.Completion]) -> None:
        if not completions:
            return
        self._pending.extend(completions)
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(self.flush_s,
                                                                      self._start_flush)

    def _start_flush(self) -> None:
        self._flush_timer = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self) -> None:
        """Sends every pending completion now."""
        pending = self._take_pending()
        if not pending:
            return
        try:
            await self._stub.Complete(router_pb2.CompleteRequest(completions=pending),
                                      timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            # The router keeps counting these until it restarts; nothing else to do here.
            log.warning("router Complete failed", extra={"error": exc.details(),
                                                         "completions": len(pending)})

    async def close(self) -> None:
        await self.flush()
        if self._flushes:
            await asyncio.gather(*self._flushes)
        await self._channel.close()


class _Channels:
    """One channel per worker address, opened on first use (TLS when `tls` is enabled)."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self._tls, _OPTIONS)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class PrefillClients(_Channels):
    """Prefill calls (frontend) and lease releases (frontend and decode workers)."""

    #: Longest wait for a Release answer; a dead prefill worker's leases expire on their own.
    RELEASE_TIMEOUT_S = 5.0

    def __init__(self, tls: TlsConfig | None = None) -> None:
        super().__init__(tls)
        self._releases: set[asyncio.Task[None]] = set()

    async def prefill(self, address: str, request: EngineRequest,
                      timeout_s: float | None = None) -> PrefillResult:
        message = prefill_pb2.PrefillRequest(
            request_id=request.request_id, token_ids=request.prompt_token_ids,
            sampling=convert.sampling_to_pb(request.sampling),
            embeddings=[convert.embedding_to_pb(e) for e in request.embeddings])
        stub = prefill_pb2_grpc.PrefillStub(self.channel(address))
        with _client_span("Prefill", "Prefill", address) as span:
            try:
                reply = await stub.Prefill(message, timeout=timeout_s, metadata=(
                    (REQUEST_ID_KEY, request.request_id), *tracing.inject(span)))
            except grpc.aio.AioRpcError as exc:
                raise status.from_rpc_error(exc, f"prefill worker {address}") from None
        return PrefillResult(
            convert.logprob_from_pb(reply.first_token),
            convert.kv_handle_from_pb(reply.kv_handle) if reply.HasField("kv_handle") else None,
            reply.cached_tokens, convert.finish_from_pb(reply.finish_reason))

    def release(self, handle: KvHandle) -> None:
        """Frees the handle's lease on its prefill worker, in the background."""
        task = asyncio.get_running_loop().create_task(self._release(handle))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, handle: KvHandle) -> None:
        stub = prefill_pb2_grpc.PrefillStub(self.channel(handle.worker_address))
        try:
            # Started in the caller's context: the Release span joins the request's trace.
            await stub.Release(prefill_pb2.ReleaseRequest(request_id=handle.request_id),
                               timeout=self.RELEASE_TIMEOUT_S,
                               metadata=((REQUEST_ID_KEY, handle.request_id),
                                         *tracing.inject(tracing.current_span())))
        except grpc.aio.AioRpcError as exc:
            log.warning("lease release failed; it will expire", extra={
                "request_id": handle.request_id, "worker": handle.worker_address,
                "error": exc.details()})

    async def close(self) -> None:
        if self._releases:
            await asyncio.gather(*self._releases)
        await super().close()


def _chunk_from_pb(msg: decode_pb2.GenerateChunk) -> TokenChunk:
    return TokenChunk(
        list(msg.token_ids),
        [convert.logprob_from_pb(lp) for lp in msg.logprobs] if msg.logprobs else [],
        convert.finish_from_pb(msg.finish_reason),
        convert.usage_from_pb(msg.usage) if msg.HasField("usage") else None,
        msg.cached_tokens if msg.HasField("cached_tokens") else None)


class DecodeClients(_Channels):
    """Generate streams to decode workers: by default every request to one worker rides on one
    Decode.Session stream (tandem.runtime.decode_session); `sessions=False` makes one
    Decode.Generate call per request instead."""

    def __init__(self, tls: TlsConfig | None = None, sessions: bool = True,
                 on_batch: BatchObserver | None = None) -> None:
        super().__init__(tls)
        self.sessions = sessions
        #: Told of every batch a session reads (the per-hop latency metrics).
        self.on_batch = on_batch
        self._sessions: dict[str, SessionChannel] = {}

    def _session(self, address: str) -> SessionChannel:
        session = self._sessions.get(address)
        if session is None or session.closed:
            session = self._sessions[address] = SessionChannel(self.channel(address), address,
                                                               self.on_batch)
        return session

    async def generate(self, address: str, request: EngineRequest,
                       timeout_s: float | None = None) -> AsyncGenerator[TokenChunk, None]:
        """Streams chunks from the worker; closing the iterator cancels the request."""
        message = decode_pb2.GenerateRequest(
            request_id=request.request_id, token_ids=request.prompt_token_ids,
            sampling=convert.sampling_to_pb(request.sampling),
            embeddings=[convert.embedding_to_pb(e) for e in request.embeddings])
        if request.kv_handle is not None and request.first_token is not None:
            message.kv_handle.CopyFrom(convert.kv_handle_to_pb(request.kv_handle))
            message.first_token.CopyFrom(convert.logprob_to_pb(request.first_token))
        with _client_span("Decode", "Generate", address) as span:
            if self.sessions:
                chunks = self._session(address).generate(
                    message, dict(tracing.inject(span)), timeout_s, _chunk_from_pb)
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
                return
            call = decode_pb2_grpc.DecodeStub(self.channel(address)).Generate(
                message, timeout=timeout_s,
                metadata=((REQUEST_ID_KEY, request.request_id), *tracing.inject(span)))
            try:
                async for msg in call:
                    yield _chunk_from_pb(msg)
            except grpc.aio.AioRpcError as exc:
                raise status.from_rpc_error(exc, f"decode worker {address}") from None
            finally:
                call.cancel()

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        await super().close()


class EncodeClients(_Channels):
    """Encode calls to encode workers (frontend)."""

    def __init__(self, model: str, tls: TlsConfig | None = None) -> None:
        super().__init__(tls)
        #: Served model name, sent with every request.
        self.model = model

    async def encode(self, address: str, request_id: str, images: Sequence[Embedding],
                     timeout_s: float | None = None) -> list[Embedding]:
        """Embeddings of `images` (items not yet encoded: their data is the image file)."""
        message = encode_pb2.EncodeRequest(request_id=request_id, model=self.model, images=[
            encode_pb2.ImageInput(data=image.data, mime_type=image.dtype,
                                  content_hash=image.content_hash)
            for image in images if isinstance(image.data, bytes)])
        stub = encode_pb2_grpc.EncodeStub(self.channel(address))
        with _client_span("Encode", "Encode", address) as span:
            try:
                reply = await stub.Encode(message, timeout=timeout_s, metadata=(
                    (REQUEST_ID_KEY, request_id), *tracing.inject(span)))
            except grpc.aio.AioRpcError as exc:
                raise status.from_rpc_error(exc, f"encode worker {address}") from None
        return [convert.embedding_from_pb(e) for e in reply.embeddings]
