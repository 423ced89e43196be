"""CLIP-style image preprocessing as a model's image processor config says.

Reproduces transformers' PIL backend (CLIPImageProcessorPil, used by LLaVA-1.5 models) step for
step, so pixel values equal what `AutoProcessor` gives: convert to RGB (transparency composited
onto white), resize (shortest edge, or an exact height/width) with Pillow, center crop (padding
with zeros when the image is smaller), rescale in float64 then cast to float32, normalize.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.errors import InvalidRequest

if TYPE_CHECKING:
    from PIL import Image

#: Where a processor saved by transformers 5 (`ProcessorMixin.save_pretrained`) keeps the image
#: processor config: nested under IMAGE_PROCESSOR_KEY, beside the processor's own keys.
PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_KEY = "image_processor"
#: The older layout, a file of its own (transformers 4, or an image processor saved alone).
CONFIG_FILE = "preprocessor_config.json"
_BICUBIC = 3
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    """The preprocessing keys of a CLIPImageProcessor config (defaults: CLIP's)."""

    do_convert_rgb: bool = True
    do_resize: bool = True
    #: Target of the shorter side, aspect ratio kept; None when height/width are exact.
    shortest_edge: int | None = 224
    #: Exact resize target (height, width), used when shortest_edge is None.
    resize_hw: tuple[int, int] | None = None
    #: Pillow resampling filter id (3: bicubic).
    resample: int = _BICUBIC
    do_center_crop: bool = True
    crop_hw: tuple[int, int] = (224, 224)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD

    @property
    def output_hw(self) -> tuple[int, int]:
        """(height, width) of the pixel values this config produces (fixed: crop or resize)."""
        if self.do_center_crop:
            return self.crop_hw
        if self.resize_hw is not None:
            return self.resize_hw
        raise InvalidRequest("the image processor has no fixed output size (no center crop and "
                             "no exact resize); such models are not supported", param="model")

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> ImageProcessorConfig:
        """Read a model directory's image processor config, found as transformers'
        `AutoImageProcessor` finds it: the IMAGE_PROCESSOR_KEY entry of processor_config.json
        when it has one (a null entry counts as none), else preprocessor_config.json.

        Raises:
            InvalidRequest: neither file holds an image processor config (the message names
                both), or the one found is unreadable or malformed.
        """
        raw, source = _find_config(pathlib.Path(path))
        try:
            return cls.from_dict(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"cannot read the image processor config in {source}: {exc}",
                                 param="model") from exc

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ImageProcessorConfig:
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        shortest = size.get("shortest_edge")
        return cls(
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)),
            do_resize=bool(raw.get("do_resize", True)),
            shortest_edge=int(shortest) if shortest is not None else None,
            resize_hw=None if shortest is not None else (int(size["height"]),
                                                          int(size["width"])),
            resample=int(raw.get("resample", _BICUBIC)),
            do_center_crop=bool(raw.get("do_center_crop", True)),
            crop_hw=(int(crop["height"]), int(crop["width"])),
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_triple(raw.get("image_mean", _CLIP_MEAN)),
            image_std=_triple(raw.get("image_std", _CLIP_STD)),
        )


def _find_config(root: pathlib.Path) -> tuple[Mapping[str, Any], str]:
    """(The raw image processor config, where it was found) in the precedence of transformers'
    `ImageProcessingMixin.get_image_processor_dict`: the nested entry first, then the file."""
    processor_file = root / PROCESSOR_FILE
    processor = _read_object(processor_file)
    nested = processor.get(IMAGE_PROCESSOR_KEY) if processor is not None else None
    if nested is not None:
        source = f"{processor_file} (key {IMAGE_PROCESSOR_KEY!r})"
        if not isinstance(nested, Mapping):
            raise InvalidRequest(f"cannot read the image processor config in {source}: "
                                 f"expected a JSON object, got {type(nested).__name__}",
                                 param="model")
        return nested, source
    legacy_file = root / CONFIG_FILE
    legacy = _read_object(legacy_file)
    if legacy is None:
        raise InvalidRequest(
            f"model directory {root} has no image processor config: neither {PROCESSOR_FILE} "
            f"with an {IMAGE_PROCESSOR_KEY!r} entry nor {CONFIG_FILE}", param="model")
    return legacy, str(legacy_file)


def _read_object(file: pathlib.Path) -> dict[str, Any] | None:
    """The JSON object in `file`; None when there is no such file."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read {file}: {exc}", param="model") from exc
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{file} does not hold a JSON object", param="model")
    return raw


def _triple(value: Any) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"expected 3 channel values, got {values}")
    return values[0], values[1], values[2]


def preprocess(image: Image.Image, config: ImageProcessorConfig) -> np.ndarray:
    """Pixel values [3, height, width] float32 of one decoded image."""
    from PIL import Image as PILImage

    if config.do_convert_rgb:
        image = _to_rgb(image)
    if config.do_resize:
        height, width = _resize_target(image.height, image.width, config)
        image = image.resize((width, height), resample=PILImage.Resampling(config.resample))
    pixels = np.moveaxis(np.asarray(image), -1, 0)  # [C, H, W] uint8
    if config.do_center_crop:
        pixels = _center_crop(pixels, config.crop_hw)
    # float64 then float32, as transformers' rescale does, so the rounding is the same.
    out = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32) \
        if config.do_rescale else pixels.astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
        out = (out - mean) / std
    return np.ascontiguousarray(out, dtype=np.float32)


def _to_rgb(image: Image.Image) -> Image.Image:
    from PIL import Image as PILImage

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _resize_target(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    if config.shortest_edge is None:
        assert config.resize_hw is not None
        return config.resize_hw
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = config.shortest_edge, int(config.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_crop(pixels: np.ndarray, crop_hw: tuple[int, int]) -> np.ndarray:
    """transformers' center_crop: cut the middle, zero-padding sides that are too short."""
    _, height, width = pixels.shape
    crop_h, crop_w = crop_hw
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
    top_pad, left_pad = ceil((new_h - height) / 2), ceil((new_w - width) / 2)
    padded[:, top_pad:top_pad + height, left_pad:left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[:, max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]
