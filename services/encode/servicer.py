"""Encode servicer: images in, engine encode, embeddings out."""
from __future__ import annotations

import grpc

from tandem.engines.base import Engine
from tandem.errors import Unavailable
from tandem.runtime import convert
from tandem.runtime.draining import Draining
from tandem.v1 import encode_pb2 as pb
from tandem.v1 import encode_pb2_grpc


class EncodeServicer(encode_pb2_grpc.EncodeServicer):
    def __init__(self, engine: Engine, draining: Draining) -> None:
        self.engine = engine
        self.draining = draining

    async def Encode(self, request: pb.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        if self.draining.active:
            raise Unavailable("encode worker is draining")
        embeddings = await self.engine.encode([image.data for image in request.images])
        return pb.EncodeResponse(embeddings=[convert.embedding_to_pb(e) for e in embeddings])
