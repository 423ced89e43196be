"""The reference engine of an encode worker: a LLaVA model's vision tower and projector alone,
with the encoder cache; no language model, no KV cache. Also builds the ImageEncoder that the
full reference engine uses for its own (aggregated fallback) images."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.encoder import ImageEncoder
from tandem.engines.reference.loader import load_vision
from tandem.engines.reference.side_engine import SideEngine
from tandem.engines.types import Embedding, EngineStats
from tandem.errors import InvalidRequest
from tandem.model.config import ModelConfig
from tandem.multimodal.encoder_cache import EncoderCache
from tandem.multimodal.processor import ImageProcessorConfig

log = logging.getLogger(__name__)


def create_image_encoder(args: EngineArgs, device: torch.device,
                         dtype: torch.dtype) -> ImageEncoder | None:
    """The vision side of the model at `args.model`; None for a text-only model."""
    vision = load_vision(args.model, dtype, device, args.load_format, args.seed)
    if vision is None:
        return None
    return ImageEncoder(vision, ImageProcessorConfig.from_dir(args.model),
                        EncoderCache(args.encoder_cache_bytes), device, dtype)


class ReferenceEncodeEngine(SideEngine):
    """Engine.encode only; every token-generating call is refused."""

    what = "the encode engine"
    refusal = ("this worker runs only the vision encoder (--disaggregation-mode encode); send "
               "prompts to a prefill or decode worker")

    def __init__(self, encoder: ImageEncoder, max_model_len: int, block_size: int) -> None:
        super().__init__(encoder.dtype, max_model_len, block_size)
        self.encoder = encoder

    async def encode(self, images: Sequence[bytes]) -> list[Embedding]:
        with self.running():
            return await asyncio.to_thread(self.encoder.embed, list(images))

    def stats(self) -> EngineStats:
        encoder = self.encoder
        return dataclasses.replace(
            super().stats(), num_encoded_images=encoder.num_encoded,
            encode_cache_hits=encoder.cache.num_hits, encode_cache_size=len(encoder.cache))


def create_encode_engine(args: EngineArgs, config: ModelConfig, device: torch.device,
                         dtype: torch.dtype) -> ReferenceEncodeEngine:
    """Raises InvalidRequest for a model without a vision encoder."""
    encoder = create_image_encoder(args, device, dtype)
    if encoder is None:
        raise InvalidRequest(f"{args.model} has no vision encoder ({config.architecture}); "
                             "encode workers need a LLaVA-style model", param="model")
    log.info("reference encode engine ready", extra={
        "device": str(device), "dtype": str(dtype), "architecture": config.architecture,
        "encoder_cache_bytes": args.encoder_cache_bytes})
    return ReferenceEncodeEngine(encoder, args.max_seq_len or config.max_position_embeddings,
                                 args.kv_block_size)
