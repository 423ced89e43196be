"""A tokenized chat prompt with its images: placeholders expanded, one multimodal item per image.

The frontend builds the items as images not yet encoded (Embedding with the image's MIME type as
dtype, see tandem.engines.types.Embedding); a deployment without encode workers sends them as
they are and the prefill (or aggregated) worker encodes them itself. With encode workers the
frontend replaces each by the embedding the Encode RPC returned (`place_embeddings`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engines.types import Embedding
from tandem.errors import UpstreamError
from tandem.kv import hashing
from tandem.multimodal.fetch import FetchedImage
from tandem.multimodal.placeholders import ImagePlaceholders, mm_hashes_per_block


@dataclass(frozen=True, slots=True)
class MultimodalPrompt:
    token_ids: tuple[int, ...]
    #: One per image, in prompt order, placed at its first placeholder token.
    items: tuple[Embedding, ...]

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the full blocks, images included, as the engines compute them
        (what Router.Route's block_hashes must be for a prompt with images)."""
        return hashing.block_hashes(self.token_ids, block_size, mm_hashes_per_block=(
            mm_hashes_per_block(self.items, len(self.token_ids), block_size)))


def build_prompt(token_ids: Sequence[int], images: Sequence[FetchedImage],
                 placeholders: ImagePlaceholders) -> MultimodalPrompt:
    """Expand the image tokens of a templated, tokenized prompt and attach its images.

    Raises:
        InvalidRequest: the prompt's image tokens and the images differ in number.
    """
    expanded = placeholders.expand(token_ids, len(images))
    items = tuple(
        Embedding(image.content_hash, (placeholders.tokens_per_image,), image.mime_type,
                  image.data, offset)
        for image, offset in zip(images, expanded.offsets, strict=True))
    return MultimodalPrompt(expanded.token_ids, items)


def place_embeddings(items: Sequence[Embedding],
                     encoded: Sequence[Embedding]) -> tuple[Embedding, ...]:
    """The encode worker's embeddings at the places of the prompt's images.

    Raises:
        UpstreamError: the encode worker answered for other images, or with embeddings whose
            token count differs from the placeholders (a model mismatch between workers).
    """
    if len(items) != len(encoded):
        raise UpstreamError(f"the encode worker returned {len(encoded)} embeddings for "
                            f"{len(items)} images")
    out = []
    for i, (item, embedding) in enumerate(zip(items, encoded, strict=True)):
        if embedding.content_hash != item.content_hash or \
                embedding.num_tokens != item.num_tokens:
            raise UpstreamError(
                f"the encode worker's embedding {i} (hash {embedding.content_hash[:12]}, "
                f"{embedding.num_tokens} tokens) does not match image {i} (hash "
                f"{item.content_hash[:12]}, {item.num_tokens} placeholder tokens)")
        out.append(Embedding(embedding.content_hash, embedding.shape, embedding.dtype,
                             embedding.data, item.placeholder_offset))
    return tuple(out)
