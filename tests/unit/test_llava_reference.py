"""The reference engine's LLaVA path against transformers on a tiny LLaVA checkpoint: pixel values
equal AutoProcessor's, the vision tower + projector equal get_image_features, and greedy tokens
with one and with two images equal LlavaForConditionalGeneration.generate, whether the engine
gets embeddings (from its own encode) or the images themselves (aggregated fallback), with and
without chunk boundaries inside an image. Images enter the block hashes; repeated images hit the
encoder cache."""
from __future__ import annotations

import asyncio
import io
import pathlib
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tandem.engines.args import EngineArgs
from tandem.engines.reference.encode_engine import ReferenceEncodeEngine
from tandem.engines.reference.engine import ReferenceEngine, create_reference_engine
from tandem.engines.types import BlockStored, Embedding, EngineRequest, SamplingParams
from tandem.errors import InvalidRequest, Unimplemented
from tandem.model.tiny_llava import write_tiny_llava
from tandem.multimodal.fetch import FetchedImage
from tandem.multimodal.image import content_hash, decode_image
from tandem.multimodal.placeholders import ImagePlaceholders
from tandem.multimodal.processor import ImageProcessorConfig, preprocess
from tandem.multimodal.prompt import MultimodalPrompt, build_prompt, place_embeddings

NEW_TOKENS = 12
BLOCK_SIZE = 4


def png(shape: tuple[int, ...], seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


IMAGES = [png((60, 80, 3), 1), png((50, 47, 3), 2), png((42, 42, 3), 3)]


class Llava:
    """transformers on the files the engine loads, and prompts built the frontend's way."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        self.dir = model_dir
        self.processor = AutoProcessor.from_pretrained(str(model_dir), backend="pil")
        self.model = LlavaForConditionalGeneration.from_pretrained(str(model_dir)).eval()
        self.placeholders = ImagePlaceholders.from_dir(model_dir)
        self._greedy: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def messages(self, text: str, num_images: int) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = [{"type": "image"}] * num_images
        return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]

    def prompt(self, text: str, images: list[bytes]) -> MultimodalPrompt:
        """Template, tokenize, expand placeholders: what the frontend does."""
        rendered = self.processor.apply_chat_template(self.messages(text, len(images)),
                                                      add_generation_prompt=True, tokenize=False)
        ids = self.processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        fetched = [FetchedImage(d, "image/png", content_hash(d)) for d in images]
        assert self.placeholders is not None
        return build_prompt(ids, fetched, self.placeholders)

    def inputs(self, text: str, images: list[bytes]) -> Any:
        """input_ids and pixel_values as LlavaProcessor makes them (the template writes BOS)."""
        rendered = self.processor.apply_chat_template(self.messages(text, len(images)),
                                                      add_generation_prompt=True, tokenize=False)
        return self.processor(text=rendered, images=[Image.open(io.BytesIO(d)) for d in images],
                              return_tensors="pt", text_kwargs={"add_special_tokens": False})

    def greedy(self, text: str, images: list[bytes]) -> list[int]:
        key = (text, tuple(content_hash(d) for d in images))
        if key not in self._greedy:
            inputs = self.inputs(text, images)
            with torch.inference_mode():
                out = self.model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                                          min_new_tokens=NEW_TOKENS)
            self._greedy[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
        return self._greedy[key]


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Llava:
    return Llava(write_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava", seed=0))


def engine_for(llava: Llava, **overrides: Any) -> Any:
    args = EngineArgs(**{"model": str(llava.dir), "device": "cpu",
                         "kv_block_size": BLOCK_SIZE, "num_gpu_blocks": 256, **overrides})
    return create_reference_engine(args)


async def generate(engine: ReferenceEngine, prompt: MultimodalPrompt,
                   items: tuple[Embedding, ...] | None = None) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one greedy request."""
    request = EngineRequest(f"r{id(prompt)}-{asyncio.get_running_loop().time()}",
                            prompt.token_ids,
                            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                           min_tokens=NEW_TOKENS),
                            embeddings=prompt.items if items is None else items)
    tokens: list[int] = []
    cached = 0
    async for chunk in engine.add_request(request):
        tokens.extend(chunk.token_ids)
        cached = chunk.usage.cached_tokens if chunk.usage else cached
    return tokens, cached


def test_pixels_and_image_features_equal_transformers(llava: Llava) -> None:
    config = ImageProcessorConfig.from_dir(llava.dir)
    engine = engine_for(llava)
    pixels = [preprocess(decode_image(d), config) for d in IMAGES]
    want = llava.processor.image_processor(images=[Image.open(io.BytesIO(d)) for d in IMAGES],
                                           return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(np.stack(pixels), want, atol=1e-6)
    with torch.inference_mode():
        got = engine.encoder.vision(torch.from_numpy(np.stack(pixels)))
        features = llava.model.get_image_features(pixel_values=torch.from_numpy(want))
    want_features = torch.stack(list(getattr(features, "pooler_output", features)))
    assert got.shape == (3, llava.placeholders.tokens_per_image, 64)
    torch.testing.assert_close(got, want_features, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_images", [1, 2])
@pytest.mark.parametrize("max_num_tokens", [8192, 7])  # 7: chunk boundaries inside images
async def test_greedy_equals_transformers(llava: Llava, num_images: int,
                                          max_num_tokens: int) -> None:
    images = IMAGES[:num_images]
    want = llava.greedy("Describe this, please.", images)
    assert want != llava.greedy("Describe this, please.", IMAGES[2:2 + num_images]), \
        "the test model's output must depend on the image"
    prompt = llava.prompt("Describe this, please.", images)
    assert list(prompt.token_ids) == llava.inputs("Describe this, please.",
                                                  images)["input_ids"][0].tolist()
    # Prefix caching off, so that every request computes its images.
    engine = engine_for(llava, max_num_tokens=max_num_tokens, enable_prefix_caching=False)
    await engine.start()
    try:
        encoded = place_embeddings(prompt.items, await engine.encode(images))
        assert (await generate(engine, prompt, encoded))[0] == want
        assert (await generate(engine, prompt))[0] == want  # images, encoded by the engine
        assert engine.pool.num_used == 0
    finally:
        await engine.close()


async def test_images_enter_block_hashes_and_the_encoder_cache(llava: Llava) -> None:
    engine = engine_for(llava)
    events: list[Any] = []
    engine.set_event_sink(events.extend)
    await engine.start()
    try:
        first = llava.prompt("What is in the picture?", IMAGES[:1])
        other = llava.prompt("What is in the picture?", IMAGES[1:2])
        assert first.token_ids == other.token_ids  # equal token ids, different images
        image_start = first.items[0].placeholder_offset
        assert (await generate(engine, first))[1] == 0
        # The KV event of the prompt's blocks names the image (for the router's prefix index).
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored[0].mm_hashes == (first.items[0].content_hash,)
        assert list(stored[0].block_hashes) == first.block_hashes(BLOCK_SIZE)  # as the router's
        assert first.block_hashes(BLOCK_SIZE) != other.block_hashes(BLOCK_SIZE)
        tokens, cached = await generate(engine, other)
        # Only the blocks before the image's first block are shared.
        assert cached == image_start // BLOCK_SIZE * BLOCK_SIZE
        assert tokens == llava.greedy("What is in the picture?", IMAGES[1:2])
        assert engine.stats().num_encoded_images == 2
        _, cached = await generate(engine, first)
        assert cached > image_start + llava.placeholders.tokens_per_image  # all but the tail

        hits = engine.stats().encode_cache_hits
        once = await engine.encode(IMAGES[:1])  # encoded by the first request already
        twice = await engine.encode(IMAGES[:1])
        stats = engine.stats()
        assert stats.encode_cache_hits == hits + 2 and stats.num_encoded_images == 2
        assert stats.encode_cache_size == 2 and once == twice
    finally:
        await engine.close()


async def test_bad_multimodal_items_fail_their_request_only(llava: Llava) -> None:
    engine = engine_for(llava)
    await engine.start()
    try:
        prompt = llava.prompt("Hi", IMAGES[:1])
        item = prompt.items[0]
        bad = [
            (Embedding(item.content_hash, (9, 64), "float32", b"\0" * 10,
                       item.placeholder_offset), "has 10 bytes"),
            (Embedding(item.content_hash, (9, 32), "float32", b"\0" * 9 * 32 * 4,
                       item.placeholder_offset), r"expected one of .* \[tokens, 64\]"),
            (Embedding(item.content_hash, (9,), "image/png", item.data, 0),
             "not placed on image tokens"),
            (Embedding(item.content_hash, (4,), "image/png", item.data,
                       item.placeholder_offset), "takes 9 per image"),
            (Embedding(item.content_hash, (9,), "image/gif", item.data,
                       item.placeholder_offset), "unsupported type"),
        ]
        for embedding, message in bad:
            with pytest.raises(InvalidRequest, match=message):
                await generate(engine, prompt, (embedding,))
        # Bytes that only look like a PNG fail in the step that encodes them, alone.
        corrupt = b"\x89PNG\r\n\x1a\n" + b"\0" * 100
        broken = Embedding(content_hash(corrupt), (9,), "image/png", corrupt,
                           item.placeholder_offset)
        results = await asyncio.gather(generate(engine, prompt, (broken,)),
                                       generate(engine, prompt), return_exceptions=True)
        assert isinstance(results[0], InvalidRequest) and "cannot be decoded" in str(results[0])
        assert results[1][0] == llava.greedy("Hi", IMAGES[:1])
        with pytest.raises(InvalidRequest, match="cannot be decoded"):  # refused at admission
            engine.add_request(EngineRequest("again", prompt.token_ids,
                                             SamplingParams(max_tokens=2), embeddings=(broken,)))
        with pytest.raises(InvalidRequest, match="images\\[1\\]: .*cannot be decoded"):
            await engine.encode([IMAGES[0], corrupt])
        assert engine.pool.num_used == 0
    finally:
        await engine.close()


async def test_a_text_model_refuses_images(tmp_path: pathlib.Path, llava: Llava) -> None:
    from tandem.model.tiny import write_tiny_model

    engine = create_reference_engine(EngineArgs(
        model=str(write_tiny_model(tmp_path / "text", "llama")), device="cpu",
        num_gpu_blocks=16))
    item = llava.prompt("Hi", IMAGES[:1]).items[0]
    with pytest.raises(InvalidRequest, match="takes no images"):
        engine.add_request(EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=1),
                                         embeddings=(item,)))
    with pytest.raises(InvalidRequest, match="no vision encoder"):
        await engine.encode(IMAGES[:1])


async def test_encode_only_engine_and_transformers5_checkpoint_names(
        llava: Llava, tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    # The same weights under transformers 5's in-memory names instead of the legacy ones.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for path in llava.dir.iterdir():
        if path.name != "model.safetensors":
            (renamed / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(llava.dir / "model.safetensors"))
    moves = [("language_model.model.", "model.language_model."),
             ("language_model.lm_head.", "lm_head."),
             ("vision_tower.", "model.vision_tower.vision_model."),
             ("multi_modal_projector.", "model.multi_modal_projector.")]
    save_file({next((new + k[len(old):] for old, new in moves if k.startswith(old)), k): v
               for k, v in tensors.items()}, str(renamed / "model.safetensors"))

    encoder = create_reference_engine(EngineArgs(model=str(renamed), device="cpu",
                                                 encode_only=True))
    assert isinstance(encoder, ReferenceEncodeEngine)
    full = engine_for(llava)
    assert await encoder.encode(IMAGES[:2]) == await full.encode(IMAGES[:2])
    assert (await encoder.encode(IMAGES[:1]))[0].shape == (9, 64)
    stats = encoder.stats()
    assert (stats.num_encoded_images, stats.encode_cache_hits, stats.encode_cache_size) == \
        (2, 1, 2)
    with pytest.raises(Unimplemented, match="only the vision encoder"):
        encoder.add_request(EngineRequest("r", (1,), SamplingParams(max_tokens=1)))
    text_engine = engine_for(llava, model=str(renamed))
    await text_engine.start()
    try:
        prompt = llava.prompt("Hi", IMAGES[:1])
        assert (await generate(text_engine, prompt))[0] == llava.greedy("Hi", IMAGES[:1])
    finally:
        await text_engine.close()
