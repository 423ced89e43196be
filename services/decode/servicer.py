"""Decode servicer: protobuf in, engine call, token chunks out (one request per Generate call,
or many over one Session stream: services.decode.session)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc

from services.decode.session import WorkerSession
from tandem.engines.base import Engine
from tandem.engines.types import EngineRequest, TokenChunk
from tandem.errors import InvalidRequest, Unavailable
from tandem.runtime import convert, tracing
from tandem.runtime.draining import Draining
from tandem.v1 import decode_pb2 as pb
from tandem.v1 import decode_pb2_grpc


def engine_request(request: pb.GenerateRequest, max_model_len: int) -> EngineRequest:
    if not request.token_ids:
        raise InvalidRequest("token_ids must not be empty", param="token_ids")
    default_max = max(max_model_len - len(request.token_ids), 1)
    return EngineRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=tuple(request.token_ids),
        sampling=convert.sampling_from_pb(request.sampling, default_max),
        kv_handle=(convert.kv_handle_from_pb(request.kv_handle)
                   if request.HasField("kv_handle") else None),
        first_token=(convert.logprob_from_pb(request.first_token)
                     if request.HasField("first_token") else None),
        embeddings=tuple(convert.embedding_from_pb(e) for e in request.embeddings),
    )


def fill_chunk(message: pb.GenerateChunk, chunk: TokenChunk) -> None:
    """Writes `chunk` into an empty GenerateChunk (in place: no copy into a SessionBatch)."""
    message.token_ids.extend(chunk.token_ids)
    if chunk.cached_tokens is not None:
        message.cached_tokens = chunk.cached_tokens
    if chunk.prompt_logprobs:
        message.prompt_logprobs.extend(convert.logprob_to_pb(lp) for lp in chunk.prompt_logprobs)
    if chunk.logprobs:
        message.logprobs.extend(convert.logprob_to_pb(lp) for lp in chunk.logprobs)
    if chunk.finish_reason is not None:
        message.finish_reason = convert.finish_to_pb(chunk.finish_reason)
        if chunk.usage is not None:
            message.usage.CopyFrom(convert.usage_to_pb(chunk.usage))


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: Engine, draining: Draining,
                 session_interval_s: float = 0.0) -> None:
        self.engine = engine
        self.draining = draining
        self.session_interval_s = session_interval_s

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        if self.draining.active:
            raise Unavailable("decode worker is draining")
        engine_req = engine_request(request, self.engine.max_model_len)
        stream = self.engine.add_request(engine_req)
        finished = False
        try:
            async for chunk in stream:
                if chunk.finish_reason is not None:
                    if chunk.usage is not None:
                        tracing.annotate({tracing.INPUT_TOKENS: chunk.usage.prompt_tokens,
                                          tracing.OUTPUT_TOKENS: chunk.usage.completion_tokens})
                    finished = True
                message = pb.GenerateChunk()
                fill_chunk(message, chunk)
                yield message
        finally:
            # Client gone, deadline passed or an error: the request's blocks go back now.
            if not finished:
                self.engine.abort(engine_req.request_id)

    async def Session(self, requests: AsyncIterator[pb.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SessionBatch]:
        async with aclosing(self.session(requests)) as batches:
            async for batch in batches:
                yield batch

    async def session(self, requests: AsyncIterator[pb.SessionRequest]
                      ) -> AsyncGenerator[pb.SessionBatch, None]:
        """One Decode.Session, whatever carries it (this gRPC call, or a Unix socket's frames:
        services.decode.session_socket)."""
        session = WorkerSession(self.engine, self.draining,
                                lambda r: engine_request(r, self.engine.max_model_len),
                                fill_chunk, self.session_interval_s)
        async with session.reading(requests):
            async for batch in session.batches():
                yield batch
