"""Embed servicer: token ids in, the engine's pooled embeddings out."""
from __future__ import annotations

import grpc

from tandem.engines.base import Engine
from tandem.errors import InvalidRequest, Unavailable
from tandem.runtime.draining import Draining
from tandem.v1 import embed_pb2 as pb
from tandem.v1 import embed_pb2_grpc


class EmbedServicer(embed_pb2_grpc.EmbedServicer):
    def __init__(self, engine: Engine, draining: Draining) -> None:
        self.engine = engine
        self.draining = draining

    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        if self.draining.active:
            raise Unavailable("embedding worker is draining")
        if not request.inputs:
            raise InvalidRequest("an embed request needs at least one input", param="inputs")
        inputs = [list(seq.token_ids) for seq in request.inputs]
        dimensions = request.dimensions if request.HasField("dimensions") else None
        vectors = await self.engine.embed(inputs, dimensions)
        return pb.EmbedResponse(embeddings=[pb.EmbeddingVector(values=v) for v in vectors],
                                prompt_tokens=sum(len(i) for i in inputs))
