"""Images as the frontend takes them apart: format checks, decoding, preprocessing equal to
transformers' CLIP image processor, placeholder expansion, content parts, the encoder cache."""
from __future__ import annotations

import io
import json
import pathlib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tandem.engines.types import Embedding
from tandem.errors import InvalidRequest, UpstreamError
from tandem.multimodal.chat import collect_images, image_part_url
from tandem.multimodal.encoder_cache import EncoderCache
from tandem.multimodal.fetch import FetchedImage
from tandem.multimodal.image import check_image_bytes, content_hash, decode_image
from tandem.multimodal.placeholders import ImagePlaceholders
from tandem.multimodal.processor import ImageProcessorConfig, preprocess
from tandem.multimodal.prompt import build_prompt, place_embeddings

RNG = np.random.default_rng(7)


def encoded(shape: tuple[int, ...], fmt: str = "PNG", mode: str | None = None) -> bytes:
    image = Image.fromarray(RNG.integers(0, 256, shape, dtype=np.uint8), mode=mode)
    buf = io.BytesIO()
    image.save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                      ("WEBP", "image/webp")])
def test_supported_formats_decode_and_are_sniffed(fmt: str, mime: str) -> None:
    data = encoded((20, 30, 3), fmt)
    assert check_image_bytes(data, "application/octet-stream") == mime
    assert decode_image(data).size == (30, 20)
    assert content_hash(data) == content_hash(bytes(data)) != content_hash(data + b"\0")


@pytest.mark.parametrize("data,declared,message", [
    (b"", None, "empty"),
    (b"GIF89a" + b"\0" * 20, None, "not PNG, JPEG or WebP"),
    (b"hello, world", None, "not PNG, JPEG or WebP"),
    (encoded((4, 4, 3)), "text/html; charset=utf-8", "got content of type 'text/html'"),
])
def test_non_images_are_refused(data: bytes, declared: str | None, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        check_image_bytes(data, declared, param="p")


def test_undecodable_and_oversized_images_are_refused() -> None:
    png = encoded((40, 40, 3))
    with pytest.raises(InvalidRequest, match="cannot be decoded"):
        decode_image(png[:len(png) // 2])  # truncated: valid header, no pixels
    with pytest.raises(InvalidRequest, match="cannot be decoded"):
        decode_image(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    with pytest.raises(InvalidRequest, match="40x40 pixels, more than"):
        decode_image(png, max_pixels=1000)


CLIP_CONFIG = {"size": {"shortest_edge": 42}, "crop_size": {"height": 42, "width": 42},
               "resample": 3, "image_mean": [0.48145466, 0.4578275, 0.40821073],
               "image_std": [0.26862954, 0.26130258, 0.27577711]}


@pytest.mark.parametrize("shape,mode", [
    ((60, 80, 3), None), ((81, 43, 3), None),  # landscape and portrait: resize + crop
    ((20, 30, 3), None),  # upscaled
    ((50, 50, 4), None),  # transparency composited onto white
    ((33, 70), None),  # grayscale
])
def test_preprocessing_equals_transformers_clip_processor(shape: tuple[int, ...],
                                                          mode: str | None) -> None:
    from transformers import CLIPImageProcessorPil

    image = decode_image(encoded(shape))
    want = CLIPImageProcessorPil(**CLIP_CONFIG)(images=[image], return_tensors="np")
    got = preprocess(image, ImageProcessorConfig.from_dict(CLIP_CONFIG))
    assert got.shape == (3, 42, 42) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want["pixel_values"][0])


def test_preprocessing_pads_when_the_crop_is_larger_than_the_image() -> None:
    from transformers import CLIPImageProcessorPil

    config = {**CLIP_CONFIG, "do_resize": False, "crop_size": {"height": 30, "width": 31}}
    image = decode_image(encoded((17, 24, 3)))
    want = CLIPImageProcessorPil(**config)(images=[image], return_tensors="np")
    got = preprocess(image, ImageProcessorConfig.from_dict(config))
    np.testing.assert_array_equal(got, want["pixel_values"][0])


def write_processor_files(root: pathlib.Path, nested: dict[str, Any] | None,
                          legacy: dict[str, Any] | None, *, with_processor_file: bool = True) -> None:
    """processor_config.json (with `nested` as its image_processor entry; the entry is null when
    `nested` is None) and, given `legacy`, preprocessor_config.json."""
    typed = {"image_processor_type": "CLIPImageProcessor"}
    if with_processor_file:
        (root / "processor_config.json").write_text(json.dumps({
            "image_processor": {**typed, **nested} if nested is not None else None,
            "processor_class": "LlavaProcessor", "patch_size": 14}))
    if legacy is not None:
        (root / "preprocessor_config.json").write_text(json.dumps({**typed, **legacy}))


SMALL_CROP = {**CLIP_CONFIG, "size": {"shortest_edge": 30},
              "crop_size": {"height": 30, "width": 28}}


@pytest.mark.parametrize("nested,legacy,with_processor_file,want_hw", [
    (CLIP_CONFIG, None, True, (42, 42)),  # transformers 5: nested only
    (None, SMALL_CROP, False, (30, 28)),  # older layout: preprocessor_config.json alone
    (None, SMALL_CROP, True, (30, 28)),  # a processor_config.json with a null entry
    (CLIP_CONFIG, SMALL_CROP, True, (42, 42)),  # both: the nested entry wins
])
def test_image_processor_config_is_found_where_transformers_finds_it(
        tmp_path: pathlib.Path, nested: dict[str, Any] | None, legacy: dict[str, Any] | None,
        with_processor_file: bool, want_hw: tuple[int, int]) -> None:
    from transformers import AutoImageProcessor

    write_processor_files(tmp_path, nested, legacy, with_processor_file=with_processor_file)
    config = ImageProcessorConfig.from_dir(tmp_path)
    assert config.output_hw == want_hw
    image = decode_image(encoded((60, 80, 3)))
    want = AutoImageProcessor.from_pretrained(str(tmp_path), backend="pil")(
        images=[image], return_tensors="np")["pixel_values"][0]
    np.testing.assert_array_equal(preprocess(image, config), want)


def test_no_image_processor_config_names_both_files(tmp_path: pathlib.Path) -> None:
    for nested_entry in (False, True):  # no processor_config.json; one without the entry
        if nested_entry:
            (tmp_path / "processor_config.json").write_text('{"patch_size": 14}')
        with pytest.raises(InvalidRequest, match=r"neither processor_config\.json with an "
                                                 r"'image_processor' entry nor "
                                                 r"preprocessor_config\.json") as info:
            ImageProcessorConfig.from_dir(tmp_path)
        assert info.value.param == "model"


@pytest.mark.parametrize("processor_text,message", [
    ("{not json", r"cannot read .*processor_config\.json"),
    ('{"image_processor": [1, 2]}', r"processor_config\.json \(key 'image_processor'\).*"
                                    r"expected a JSON object"),
    ('{"image_processor": {"image_mean": [0.5, 0.5]}}', r"key 'image_processor'.*3 channel"),
])
def test_malformed_image_processor_config_is_invalid_request(
        tmp_path: pathlib.Path, processor_text: str, message: str) -> None:
    write_processor_files(tmp_path, None, CLIP_CONFIG, with_processor_file=False)
    (tmp_path / "processor_config.json").write_text(processor_text)
    with pytest.raises(InvalidRequest, match=message):
        ImageProcessorConfig.from_dir(tmp_path)


def test_placeholders_follow_the_feature_select_strategy() -> None:
    config = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 9,
              "vision_config": {"image_size": 336, "patch_size": 14}}
    assert ImagePlaceholders.from_config(config) == ImagePlaceholders(9, 576)
    full = ImagePlaceholders.from_config({**config, "vision_feature_select_strategy": "full"})
    assert full == ImagePlaceholders(9, 577)
    assert ImagePlaceholders.from_config({"architectures": ["LlamaForCausalLM"]}) is None


def image(tag: bytes) -> FetchedImage:
    return FetchedImage(tag, "image/png", content_hash(tag))


def test_prompt_expansion_places_each_image_at_its_run() -> None:
    placeholders = ImagePlaceholders(image_token_id=9, tokens_per_image=3)
    prompt = build_prompt([1, 9, 5, 6, 9, 2], [image(b"a"), image(b"b")], placeholders)
    assert prompt.token_ids == (1, 9, 9, 9, 5, 6, 9, 9, 9, 2)
    assert [item.placeholder_offset for item in prompt.items] == [1, 6]
    assert all(item.is_image and item.num_tokens == 3 for item in prompt.items)
    assert prompt.items[0].content_hash == content_hash(b"a")
    with pytest.raises(InvalidRequest, match="2 image placeholders but the request has 1"):
        build_prompt([1, 9, 9], [image(b"a")], placeholders)

    vectors = [Embedding(item.content_hash, (3, 8), "float32", b"\0" * 96)
               for item in prompt.items]
    placed = place_embeddings(prompt.items, vectors)
    assert [e.placeholder_offset for e in placed] == [1, 6]
    assert not placed[0].is_image and placed[0].num_tokens == 3
    with pytest.raises(UpstreamError, match="does not match image 0"):
        place_embeddings(prompt.items, vectors[::-1])


def test_image_content_parts() -> None:
    url = "data:image/png;base64,AAAA"
    assert image_part_url({"type": "image_url", "image_url": {"url": url}}, "p") == url
    assert image_part_url({"type": "image_url", "image_url": url}, "p") == url
    with pytest.raises(InvalidRequest, match=r"'p.image_url.url' must be a non-empty string"):
        image_part_url({"type": "image_url", "image_url": {"url": ""}}, "p")
    with pytest.raises(InvalidRequest, match="detail"):
        image_part_url({"type": "image_url", "image_url": {"url": url, "detail": "max"}}, "p")
    messages = [{"role": "system", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "u1"}},
                                             {"type": "input_image", "image_url": "u2"}]}]
    refs = collect_images(messages)
    assert [(r.url, r.param) for r in refs] == [("u1", "messages[1].content[1]"),
                                                ("u2", "messages[1].content[2]")]


def test_encoder_cache_is_lru_by_bytes() -> None:
    cache: EncoderCache[str] = EncoderCache(capacity_bytes=10)
    cache.put("a", "A", 4)
    cache.put("b", "B", 4)
    assert cache.get("a") == "A"  # now b is the least recently used
    cache.put("c", "C", 4)
    assert "b" not in cache and cache.get("c") == "C" and cache.num_bytes == 8
    assert cache.get("b") is None
    assert (cache.num_hits, cache.num_misses) == (2, 1)
    cache.put("huge", "H", 11)  # larger than the cache: not kept, nothing evicted
    assert len(cache) == 2
    off: EncoderCache[str] = EncoderCache(0)
    off.put("a", "A", 1)
    assert off.get("a") is None
