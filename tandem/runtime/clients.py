"""gRPC clients the frontend uses to reach the workers (the router's is in router_client.py).
They speak domain types and raise typed errors, so the request pipeline above them has no grpc
import."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import AbstractContextManager, aclosing
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind

from tandem.engines.types import Embedding, EngineRequest, KvHandle, PrefillResult, TokenChunk
from tandem.runtime import convert, status, tracing, unix_sockets
from tandem.runtime.decode_session import BatchObserver, GrpcCall, SessionChannel, SocketCall
from tandem.runtime.interceptor import REQUEST_ID_KEY
from tandem.runtime.tasks import spawn
from tandem.runtime.tls import TlsConfig, aio_channel
from tandem.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    embed_pb2,
    embed_pb2_grpc,
    encode_pb2,
    encode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

log = logging.getLogger(__name__)
_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024)]
def _client_span(service: str, method: str, address: str) -> AbstractContextManager[Span]:
    """A client span for one call (its context goes out in the metadata: tracing.inject)."""
    return tracing.span(f"tandem.v1.{service}/{method}", SpanKind.CLIENT, {
        "rpc.system": "grpc", "rpc.service": f"tandem.v1.{service}", "rpc.method": method,
        "server.address": address}, current=False)


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
        spawn(self._release(handle), self._releases)

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
            path = None if self._tls is not None and self._tls.enabled else \
                unix_sockets.session_dial_path(address)
            call = SocketCall(path, address) if path else GrpcCall(self.channel(address), address)
            session = self._sessions[address] = SessionChannel(call, address, self.on_batch)
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


@dataclass(frozen=True, slots=True)
class Embeddings:
    """An embedding worker's answer: one vector per input, and the inputs' tokens."""

    vectors: list[list[float]]
    prompt_tokens: int


class EmbedClients(_Channels):
    """Embed calls to embedding workers (frontend)."""

    def __init__(self, model: str, tls: TlsConfig | None = None) -> None:
        super().__init__(tls)
        #: Served model name, sent with every request.
        self.model = model

    async def embed(self, address: str, request_id: str, inputs: Sequence[Sequence[int]],
                    dimensions: int | None, timeout_s: float | None = None) -> Embeddings:
        """One vector per input, from the worker at `address`.

        Raises:
            TandemError: the worker's status as a typed error (Unavailable when unreachable
                or draining, InvalidRequest for inputs it refuses, ...).
        """
        message = embed_pb2.EmbedRequest(
            request_id=request_id, model=self.model,
            inputs=[embed_pb2.TokenSequence(token_ids=ids) for ids in inputs],
            dimensions=dimensions)
        stub = embed_pb2_grpc.EmbedStub(self.channel(address))
        with _client_span("Embed", "Embed", address) as span:
            try:
                reply = await stub.Embed(message, timeout=timeout_s, metadata=(
                    (REQUEST_ID_KEY, request_id), *tracing.inject(span)))
            except grpc.aio.AioRpcError as exc:
                raise status.from_rpc_error(exc, f"embedding worker {address}") from None
        return Embeddings([list(v.values) for v in reply.embeddings], reply.prompt_tokens)
