"""Image placeholder tokens: how many a model takes per image and where they sit in a prompt.

A LLaVA chat template writes one image token per image; the model then needs one token per
embedding row, so each is expanded into `tokens_per_image` copies (as transformers'
LlavaProcessor does to the text). The i-th image of the request belongs to the i-th placeholder
run. Expansion works on token ids, after tokenization: the image token is a special token, so it
never merges with its neighbours and text never produces it by accident... unless a user types
the token's literal text, which then shows up as a count mismatch and a clear error.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.engines.types import Embedding
from tandem.errors import InvalidRequest

#: Architectures whose config.json this module reads, and that the reference engine runs.
LLAVA_ARCHITECTURES = frozenset({"LlavaForConditionalGeneration"})


@dataclass(frozen=True, slots=True)
class ExpandedPrompt:
    token_ids: tuple[int, ...]
    #: Index of the first placeholder token of each image, in image order.
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ImagePlaceholders:
    """How a vision-language model marks images in its prompt."""

    image_token_id: int
    #: Embedding rows (and so placeholder tokens) per image.
    tokens_per_image: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ImagePlaceholders | None:
        """From a parsed config.json; None for a text-only model.

        LLaVA: a CLIP tower of `image_size` with `patch_size` patches makes (image_size /
        patch_size)^2 patch features plus one CLS feature; the "default" feature-select strategy
        drops the CLS one, "full" keeps it.
        Raises:
            InvalidRequest: a LLaVA config this module cannot size.
        """
        architecture = (config.get("architectures") or [""])[0]
        if architecture not in LLAVA_ARCHITECTURES:
            return None
        try:
            vision = config["vision_config"]
            token_id = config.get("image_token_index", config.get("image_token_id"))
            patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
            strategy = config.get("vision_feature_select_strategy", "default")
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"cannot read the image layout from config.json: {exc}",
                                 param="model") from exc
        if strategy not in ("default", "full"):
            raise InvalidRequest(f"unsupported vision_feature_select_strategy {strategy!r} "
                                 "(supported: default, full)", param="model")
        if not isinstance(token_id, int):
            raise InvalidRequest("config.json has no image_token_index", param="model")
        return cls(token_id, patches + (1 if strategy == "full" else 0))

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> ImagePlaceholders | None:
        config_file = pathlib.Path(path) / "config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"cannot read {config_file}: {exc}", param="model") from exc
        return cls.from_config(config)

    def expand(self, token_ids: Sequence[int], num_images: int) -> ExpandedPrompt:
        """Replace each image token by `tokens_per_image` copies.

        Raises:
            InvalidRequest: the prompt's image tokens and the request's images differ in number
                (e.g. the text itself contained the image token).
        """
        out: list[int] = []
        offsets: list[int] = []
        for token in token_ids:
            if token == self.image_token_id:
                offsets.append(len(out))
                out.extend([token] * self.tokens_per_image)
            else:
                out.append(token)
        if len(offsets) != num_images:
            raise InvalidRequest(
                f"the prompt has {len(offsets)} image placeholders but the request has "
                f"{num_images} images (does the text contain the model's image token?)",
                param="messages")
        return ExpandedPrompt(tuple(out), tuple(offsets))


def mm_hashes_per_block(items: Sequence[Embedding], num_tokens: int,
                        block_size: int) -> list[tuple[str, ...]] | None:
    """Content hashes of the items touching each full block of a `num_tokens` prompt (None
    without items): the `mm_hashes_per_block` of tandem.kv.hashing.block_hashes. An item covers
    `num_tokens` placeholder tokens from its `placeholder_offset` (see Embedding). The engines
    hash their blocks with it, and a caller routing by block hashes must too."""
    if not items:
        return None
    num_blocks = num_tokens // block_size
    per_block: list[list[str]] = [[] for _ in range(num_blocks)]
    for item in items:
        first = item.placeholder_offset // block_size
        last = (item.placeholder_offset + max(item.num_tokens, 1) - 1) // block_size
        for b in range(first, min(last + 1, num_blocks)):
            per_block[b].append(item.content_hash)
    return [tuple(hashes) for hashes in per_block]
