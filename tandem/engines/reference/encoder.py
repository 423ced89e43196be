"""ImageEncoder: images to embedding tensors through preprocessing, the LLaVA vision model and the
encoder cache; and multimodal items (Embedding) to the rows a prefill step places at their
placeholder tokens.

`encode` and `rows` run in worker threads (they touch tensors only); `validate` runs on the event
loop at admission and checks everything that could make the step fail later, so that a bad item
fails its own request and never the step loop.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tandem.engines.reference.vision import LlavaVision
from tandem.engines.types import Embedding
from tandem.errors import InvalidRequest, TandemError
from tandem.multimodal.encoder_cache import EncoderCache
from tandem.multimodal.image import SUPPORTED_MIME_TYPES, content_hash, decode_image
from tandem.multimodal.processor import ImageProcessorConfig, preprocess

#: Element types an encoded Embedding may carry.
EMBEDDING_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                    "bfloat16": torch.bfloat16}
#: Most images in one vision forward pass (bounds the activation memory).
MAX_IMAGES_PER_BATCH = 32


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's row-major bytes, dtype kept (bfloat16 included, which numpy lacks)."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return bytes(flat.view(torch.uint8).numpy().tobytes())


@dataclass(frozen=True, slots=True)
class MultimodalSpan:
    """Rows [item_row, item_row + count) of `item` go to batch rows [batch_row, ...)."""

    batch_row: int
    item: Embedding
    item_row: int
    count: int


class ImageEncoder:
    """The vision side of a LLaVA model on one device."""

    def __init__(self, vision: LlavaVision, processor: ImageProcessorConfig,
                 cache: EncoderCache[torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.vision = vision
        self.processor = processor
        self.cache = cache
        self.device = device
        self.dtype = dtype
        spec = vision.spec
        self.image_token_id = spec.image_token_id
        self.tokens_per_image = spec.tokens_per_image
        self.hidden_size = spec.text_hidden_size
        self.num_encoded = 0
        self._lock = threading.Lock()
        if processor.output_hw != (spec.image_size, spec.image_size):
            raise InvalidRequest(
                f"the image processor makes {processor.output_hw} images but the vision tower "
                f"takes {spec.image_size}x{spec.image_size}", param="model")

    # ---- admission (event loop) ---------------------------------------------------------------

    def validate(self, items: Sequence[Embedding], prompt: Sequence[int]) -> None:
        """Checks each item against the prompt and the model.

        Raises:
            InvalidRequest: an item outside the prompt, overlapping another, not on image tokens,
                of the wrong size or type, or referenced over NIXL (not supported here).
        """
        end = 0
        for i, item in sorted(enumerate(items), key=lambda pair: pair[1].placeholder_offset):
            param = f"embeddings[{i}]"
            start, length = item.placeholder_offset, item.num_tokens
            if start < end or start + length > len(prompt):
                raise InvalidRequest(f"{param} covers tokens [{start}, {start + length}), which "
                                     f"overlap another item or pass the prompt's "
                                     f"{len(prompt)} tokens", param=param)
            if any(t != self.image_token_id for t in prompt[start:start + length]):
                raise InvalidRequest(f"{param} is not placed on image tokens "
                                     f"(id {self.image_token_id})", param=param)
            end = start + length
            if length != self.tokens_per_image:
                raise InvalidRequest(f"{param} covers {length} tokens; this model takes "
                                     f"{self.tokens_per_image} per image", param=param)
            if not isinstance(item.data, bytes):
                raise InvalidRequest(f"{param} is a NIXL reference; the reference engine takes "
                                     "embeddings as bytes", param=param)
            if item.is_image:
                if item.dtype not in SUPPORTED_MIME_TYPES:
                    raise InvalidRequest(f"{param} is of unsupported type {item.dtype}",
                                         param=param)
                continue
            if item.dtype not in EMBEDDING_DTYPES or item.shape != (length, self.hidden_size):
                raise InvalidRequest(
                    f"{param} is {item.dtype} {list(item.shape)}; expected one of "
                    f"{', '.join(EMBEDDING_DTYPES)} [tokens, {self.hidden_size}]", param=param)
            size = math.prod(item.shape) * EMBEDDING_DTYPES[item.dtype].itemsize
            if len(item.data) != size:
                raise InvalidRequest(f"{param} has {len(item.data)} bytes; its shape and dtype "
                                     f"need {size}", param=param)

    # ---- worker threads -----------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, images: Iterable[tuple[str, bytes]]
               ) -> tuple[dict[str, torch.Tensor], dict[str, TandemError]]:
        """Embeddings [tokens_per_image, hidden] by content hash, from the cache or the model,
        and the images that could not be decoded (by hash, with the reason)."""
        found: dict[str, torch.Tensor] = {}
        errors: dict[str, TandemError] = {}
        pixels: dict[str, torch.Tensor] = {}
        for key, data in images:
            if key in found or key in errors or key in pixels:
                continue
            cached = self.cache.get(key)
            if cached is not None:
                found[key] = cached
                continue
            try:
                pixels[key] = torch.from_numpy(preprocess(decode_image(data), self.processor))
            except TandemError as exc:
                errors[key] = exc
        keys = list(pixels)
        for start in range(0, len(keys), MAX_IMAGES_PER_BATCH):
            batch = keys[start:start + MAX_IMAGES_PER_BATCH]
            stacked = torch.stack([pixels[k] for k in batch]).to(self.device, self.dtype)
            for key, row in zip(batch, self.vision(stacked), strict=True):
                embedding = row.clone()  # a view would keep the whole batch's output alive
                found[key] = embedding
                self.cache.put(key, embedding, embedding.numel() * embedding.element_size())
        with self._lock:
            self.num_encoded += len(keys)
        return found, errors

    def embed(self, images: Sequence[bytes]) -> list[Embedding]:
        """Engine.encode's work: one Embedding (row-major bytes in the model dtype) per image,
        in order.

        Raises:
            InvalidRequest: naming the first image that cannot be decoded.
        """
        keys = [content_hash(data) for data in images]
        encoded, errors = self.encode(zip(keys, images, strict=True))
        for i, key in enumerate(keys):
            if key in errors:
                raise InvalidRequest(f"images[{i}]: {errors[key].message}", param=f"images[{i}]")
        dtype = str(self.dtype).removeprefix("torch.")
        return [Embedding(key, tuple(encoded[key].shape), dtype, tensor_bytes(encoded[key]))
                for key in keys]

    def rows(self, spans: Sequence[MultimodalSpan], encoded: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch rows [M] int64, values [M, hidden]) for the model to place: image items from
        `encoded`, byte items read from just the rows needed."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for span in spans:
            item = span.item
            if item.is_image:
                value = encoded[item.content_hash][span.item_row:span.item_row + span.count]
            else:
                assert isinstance(item.data, bytes)
                dtype = EMBEDDING_DTYPES[item.dtype]
                row_bytes = self.hidden_size * dtype.itemsize
                raw = bytearray(item.data[span.item_row * row_bytes:
                                          (span.item_row + span.count) * row_bytes])
                value = torch.frombuffer(raw, dtype=dtype).view(span.count, self.hidden_size)
            values.append(value.to(self.device, self.dtype))
            rows.append(torch.arange(span.batch_row, span.batch_row + span.count))
        return torch.cat(rows).to(self.device), torch.cat(values)
