"""Prefill servicer: protobuf in, engine prefill/release, protobuf out; each call counted in
what the worker served (tandem.runtime.served)."""
from __future__ import annotations

import dataclasses

import grpc

from tandem.engines.base import Engine
from tandem.engines.types import EngineRequest, KvHandle
from tandem.errors import InvalidRequest, Unavailable
from tandem.runtime import convert, tracing
from tandem.runtime.draining import Draining
from tandem.runtime.served import ServedTally
from tandem.v1 import prefill_pb2 as pb
from tandem.v1 import prefill_pb2_grpc


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: Engine, draining: Draining, default_lease_ms: int,
                 worker_id: str, served: ServedTally) -> None:
        self.engine = engine
        self.draining = draining
        self.default_lease_ms = default_lease_ms
        #: Also the address decode workers call Release on (host:port).
        self.worker_id = worker_id
        self.served = served

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        try:
            response, handle = await self._prefill(request)
        except BaseException:  # refused, cancelled or failed: counted, then raised as it is
            self.served.prefill_failed()
            raise
        self.served.prefill_served(handle)
        return response

    async def _prefill(self, request: pb.PrefillRequest
                       ) -> tuple[pb.PrefillResponse, KvHandle | None]:
        if self.draining.active:
            raise Unavailable("prefill worker is draining")
        if not request.token_ids:
            raise InvalidRequest("token_ids must not be empty", param="token_ids")
        if not request.request_id:
            raise InvalidRequest("request_id must not be empty (it names the lease)",
                                 param="request_id")
        engine_req = EngineRequest(
            request_id=request.request_id, prompt_token_ids=tuple(request.token_ids),
            sampling=convert.sampling_from_pb(
                request.sampling, max(self.engine.max_model_len - len(request.token_ids), 1)),
            embeddings=tuple(convert.embedding_from_pb(e) for e in request.embeddings))
        lease_ms = request.lease_ms if request.HasField("lease_ms") else self.default_lease_ms
        result = await self.engine.prefill(engine_req, lease_ms)
        tracing.annotate({tracing.INPUT_TOKENS: len(request.token_ids),
                          "tandem.cached_tokens": result.cached_tokens})
        response = pb.PrefillResponse(first_token=convert.logprob_to_pb(result.first_token),
                                      cached_tokens=result.cached_tokens,
                                      finish_reason=convert.finish_to_pb(result.finish_reason))
        if result.kv_handle is None:
            return response, None
        handle = dataclasses.replace(result.kv_handle, worker_id=self.worker_id,
                                     worker_address=self.worker_id)
        response.kv_handle.CopyFrom(convert.kv_handle_to_pb(handle))
        return response, handle

    async def Release(self, request: pb.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        released = await self.engine.release(request.request_id)
        self.served.release_answered(request.request_id, released)
        return pb.ReleaseResponse(released=released)
