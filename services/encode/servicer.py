"""Encode servicer: images in, engine encode, embeddings out."""
from __future__ import annotations

import grpc

from tandem.engines.base import Engine
from tandem.errors import Unavailable
from tandem.runtime.server import Draining
from tandem.v1 import common_pb2, encode_pb2_grpc
from tandem.v1 import encode_pb2 as pb


class EncodeServicer(encode_pb2_grpc.EncodeServicer):
    def __init__(self, engine: Engine, draining: Draining) -> None:
        self.engine = engine
        self.draining = draining

    async def Encode(self, request: pb.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        if self.draining.active:
            raise Unavailable("encode worker is draining")
        embeddings = await self.engine.encode([image.data for image in request.images])
        return pb.EncodeResponse(embeddings=[
            common_pb2.MultimodalEmbedding(content_hash=e.content_hash, shape=e.shape,
                                           dtype=e.dtype, raw=e.data)
            for e in embeddings if isinstance(e.data, bytes)])
