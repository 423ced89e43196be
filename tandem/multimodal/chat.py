"""Image content parts of OpenAI chat messages, for the frontend's request parser.

Accepted shapes, as OpenAI and vLLM accept them:
    {"type": "image_url", "image_url": {"url": "...", "detail": "auto"}}
    {"type": "image_url", "image_url": "..."}          (vLLM's shorthand)
    {"type": "input_image", "image_url": "..."}        (the Responses API's part)
An image part reaches the chat template as TEMPLATE_IMAGE_PART, where it renders the model's
image token; the i-th image part of the conversation is the i-th image of the request.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.errors import InvalidRequest

#: Content part types that carry an image.
IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
#: What an image part becomes in the messages given to the chat template (Hugging Face
#: templates test `part['type'] == 'image'`).
TEMPLATE_IMAGE_PART: Mapping[str, str] = {"type": "image"}
#: Most images one request may carry.
MAX_IMAGES_PER_REQUEST = 16
_DETAILS = frozenset({"auto", "low", "high"})


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image of a request: its URL and the request field it came from (for errors)."""

    url: str
    param: str


def image_part_url(part: Mapping[str, object], param: str) -> str:
    """The URL of one image content part.

    Raises:
        InvalidRequest: no URL, a URL that is not a non-empty string, or an unknown `detail`.
    """
    value = part.get("image_url")
    where = f"{param}.image_url"
    if isinstance(value, Mapping):
        detail = value.get("detail", "auto")
        if detail not in _DETAILS:
            raise InvalidRequest(f"'{where}.detail' must be one of auto, low, high, got "
                                 f"{detail!r}", param=f"{where}.detail")
        value = value.get("url")
        where += ".url"
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{where}' must be a non-empty string (a data:, http(s):// or "
                             "file URL)", param=where)
    return value


def collect_images(messages: Sequence[Mapping[str, object]]) -> list[ImageRef]:
    """The images of a conversation in order, from messages as the client sent them.

    Raises:
        InvalidRequest: a malformed image part, or more than MAX_IMAGES_PER_REQUEST images.
    """
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                param = f"messages[{i}].content[{j}]"
                refs.append(ImageRef(image_part_url(part, param), param))
    if len(refs) > MAX_IMAGES_PER_REQUEST:
        raise InvalidRequest(f"a request may carry at most {MAX_IMAGES_PER_REQUEST} images, got "
                             f"{len(refs)}", param="messages")
    return refs
