"""Fake of tensorrt_llm/inputs (utils.py `default_multimodal_input_loader`, `load_image`).

Upstream loads each media item with load_image, which accepts http(s) URLs, local paths and
base64 `data:` URLs and returns a tensor or PIL image; the fake accepts only `data:` URLs and
returns the decoded bytes (it has no image library), then builds the same
`{"prompt", "multi_modal_data": {"image": [...]}}` inputs.
"""
from __future__ import annotations

import base64
from typing import Any
from urllib.parse import urlparse


def load_image(image: str, format: str = "pt", device: str = "cpu") -> bytes:
    parsed = urlparse(image)
    if parsed.scheme != "data":
        raise ValueError(f"the fake loads only data: URLs, got scheme {parsed.scheme!r}")
    spec, data = parsed.path.split(",", 1)
    _media_type, data_type = spec.split(";", 1)
    if data_type != "base64":
        raise NotImplementedError("Only base64 data URLs are supported for now.")
    return base64.b64decode(data)


def default_multimodal_input_loader(
        *, tokenizer: Any, model_dir: str, model_type: str, modality: str, prompts: list[str],
        media: list[str] | list[list[str]] | None = None, image_data_format: str = "pt",
        num_frames: int = 8, mm_embeddings: Any = None,
        device: str = "cpu") -> list[dict[str, Any]]:
    if modality not in ("image", "multiple_image"):
        raise ValueError(f"the fake supports image modality only, got {modality}")
    if media is None or len(media) != len(prompts):
        raise ValueError("one media entry per prompt is required")
    inputs = []
    for prompt, items in zip(prompts, media):
        urls = [items] if isinstance(items, str) else list(items)
        inputs.append({"prompt": "<image>\n" * len(urls) + prompt,
                       "multi_modal_data": {"image": [load_image(u, image_data_format, device)
                                                      for u in urls]}})
    return inputs
