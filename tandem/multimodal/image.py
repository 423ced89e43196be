"""Image bytes: format sniffing, decoding with limits, and the content hash.

The content hash is the hex SHA-256 of the image file's bytes exactly as the client sent them
(after base64 or HTTP decoding). It keys the encoder cache and enters the hashes of the KV blocks
the image's placeholder tokens fall into. Hashing the file rather than the decoded pixels costs no
decode, so the frontend (and the router) can compute it before anything else; the price is that
the same picture saved twice in different files counts as two images, which only costs a cache
miss, never a wrong answer.
"""
from __future__ import annotations

import hashlib
import io
import warnings
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequest

if TYPE_CHECKING:
    from PIL import Image

#: The formats Tandem accepts, by MIME type; each maps to its Pillow format name.
SUPPORTED_MIME_TYPES: dict[str, str] = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/webp": "WEBP",
}
#: Largest decoded image accepted, pixels (width x height): 8192 x 8192. Guards against
#: decompression bombs: a small file that decodes to gigabytes.
MAX_IMAGE_PIXELS = 8192 * 8192


def content_hash(data: bytes) -> str:
    """Hex SHA-256 of an image file's bytes: the identity of the image everywhere in Tandem."""
    return hashlib.sha256(data).hexdigest()


def sniff_mime_type(data: bytes) -> str | None:
    """The MIME type of a supported image format from its magic bytes, None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if len(data) >= 12 and data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def check_image_bytes(data: bytes, declared_mime: str | None = None, *,
                      param: str | None = None) -> str:
    """The MIME type of `data`, after checking it is a supported image by its content.

    Args:
        declared_mime: the type the client or server declared (a data URL's type, an HTTP
            Content-Type); when it is given and is not an image type (nor the generic
            application/octet-stream), the input is refused even if the bytes look like one.
    Raises:
        InvalidRequest: empty, a declared non-image type, or bytes of no supported format.
    """
    if not data:
        raise InvalidRequest("the image is empty", param=param)
    declared = (declared_mime or "").split(";")[0].strip().lower()
    if declared and declared != "application/octet-stream" and \
            not declared.startswith("image/"):
        raise InvalidRequest(f"expected an image, got content of type '{declared}'",
                             param=param)
    sniffed = sniff_mime_type(data)
    if sniffed is None:
        raise InvalidRequest("the image is not PNG, JPEG or WebP (unrecognised bytes)",
                             param=param)
    return sniffed


def decode_image(data: bytes, *, param: str | None = None,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode an image file fully (so truncated or corrupt files fail here, not later).

    Raises:
        InvalidRequest: not a supported format, more than `max_pixels` pixels, or undecodable.
    """
    from PIL import Image, UnidentifiedImageError

    mime = check_image_bytes(data, param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[SUPPORTED_MIME_TYPES[mime]])
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidRequest(f"the image is {width}x{height} pixels, more than the "
                                     f"{max_pixels} accepted", param=param)
            image.load()
    except InvalidRequest:
        raise
    except UnidentifiedImageError as exc:  # its message names a BytesIO object: say it plainly
        raise InvalidRequest(f"the image cannot be decoded ({mime}): not a valid {mime} file",
                             param=param) from exc
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise InvalidRequest(f"the image cannot be decoded ({mime}): {exc}", param=param) from exc
    return image
