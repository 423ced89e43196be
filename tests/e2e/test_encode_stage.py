"""The encode stage end to end: `tandem up --disagg --encode-ports` with the reference engine and
a tiny LLaVA on CPU, so each request runs frontend -> encode -> prefill -> decode in separate
processes. Greedy tokens with one and with two images equal transformers'
LlavaForConditionalGeneration.generate and the aggregated fallback (the decode worker given the
images themselves); equal text with different images shares no image block; a repeated image hits
the encode worker's cache; bad media is a clear 400 that leaves every service up. The public gRPC
API (Inference.Generate with image parts) gives the same tokens, and INVALID_ARGUMENT for bad
media."""
from __future__ import annotations

import base64
import http.server
import pathlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from tandem.multimodal.prompt import MultimodalPrompt
from tandem.runtime import convert
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.e2e.disagg_probe import stats
from tests.e2e.topology import Topology, start_topology
from tests.unit.test_llava_reference import IMAGES, NEW_TOKENS, Llava, png

BLOCK_SIZE = 4
MAX_FILE_MB = 0.1
TEXT = "Describe this, please."


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class _Hang(http.server.BaseHTTPRequestHandler):
    """Answers nothing for longer than the frontend's fetch timeout."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(3)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem.model.tiny_llava import write_tiny_llava

    return write_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava", seed=0)


@pytest.fixture(scope="module")
def llava(model_dir: pathlib.Path) -> Llava:
    return Llava(model_dir)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def hang_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hang)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    server.shutdown()


@pytest.fixture(scope="module")
def topo(model_dir: pathlib.Path, media_dir: pathlib.Path) -> Iterator[Topology]:
    topo = start_topology(
        "--engine", "reference", "--device", "cpu", "--kv-block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", "256", "--model", str(model_dir),
        "--max-file-size-mb", str(MAX_FILE_MB), "--media-fetch-timeout-s", "1",
        "--allowed-media-networks", "127.0.0.0/8", "--allowed-local-media-path", str(media_dir),
        num_prefill=1, num_encode=1)
    try:
        yield topo
    finally:
        assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, topo: Topology, text: str, urls: list[str]) -> Any:
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
               {"type": "text", "text": text}]
    return client.chat.completions.create(
        model=topo.model, messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
        extra_body={"min_tokens": NEW_TOKENS, "skip_special_tokens": False})


def token_texts(llava: Llava, ids: list[int]) -> list[str]:
    return [llava.processor.tokenizer.decode([i]) for i in ids]


def generate_aggregated(address: str, prompt: MultimodalPrompt) -> list[int]:
    """Decode.Generate straight to a worker with the images themselves (no encode worker)."""
    request = decode_pb2.GenerateRequest(
        request_id=f"agg-{time.monotonic_ns()}", token_ids=prompt.token_ids,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                           min_tokens=NEW_TOKENS),
        embeddings=[convert.embedding_to_pb(item) for item in prompt.items])
    with grpc.insecure_channel(address) as channel:
        return [t for chunk in decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60)
                for t in chunk.token_ids]


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_through_the_encode_stage_equals_transformers_and_the_fallback(
        topo: Topology, client: openai.OpenAI, llava: Llava, num_images: int) -> None:
    images = IMAGES[:num_images]
    want = llava.greedy(TEXT, images)
    prompt = llava.prompt(TEXT, images)
    (encoder,), (prefill,), (decode,) = (topo.encode_addresses, topo.prefill_addresses,
                                         topo.decode_addresses)

    def tower_runs(address: str) -> int:
        s = stats(address)
        return s.num_encoded_images + s.encode_cache_hits

    # The aggregated fallback first (so that no cached block spares the decode worker its own
    # encoding): it gets the images themselves and runs its vision tower.
    runs = tower_runs(decode)
    assert generate_aggregated(decode, prompt) == want
    assert tower_runs(decode) > runs

    before = {a: tower_runs(a) for a in (encoder, prefill, decode)}
    reply = ask(client, topo, TEXT, [data_url(d) for d in images])
    assert [e.token for e in reply.choices[0].logprobs.content] == token_texts(llava, want)
    assert reply.usage.prompt_tokens == len(prompt.token_ids)
    # The encode worker embedded the images (or had them cached); nobody else ran the tower.
    assert tower_runs(encoder) - before[encoder] == num_images
    assert tower_runs(prefill) == before[prefill] and tower_runs(decode) == before[decode]


def test_equal_text_with_other_images_shares_no_image_block(
        topo: Topology, client: openai.OpenAI, llava: Llava) -> None:
    text = "What is in the picture?"
    mine, others = IMAGES[2], png((64, 40, 3), 21)  # images no earlier request carried
    first, other = llava.prompt(text, [mine]), llava.prompt(text, [others])
    assert first.token_ids == other.token_ids
    # Blocks before the image's first block may be cached from earlier requests; no later one.
    shared = first.items[0].placeholder_offset // BLOCK_SIZE * BLOCK_SIZE

    def cached(reply: Any) -> int:
        return int(reply.usage.prompt_tokens_details.cached_tokens)

    assert cached(ask(client, topo, text, [data_url(mine)])) == shared
    reply = ask(client, topo, text, [data_url(others)])
    assert cached(reply) == shared
    assert [e.token for e in reply.choices[0].logprobs.content] == \
        token_texts(llava, llava.greedy(text, [others]))
    # The same image again: its blocks are cached, all but the last partial block.
    assert cached(ask(client, topo, text, [data_url(mine)])) == \
        (len(first.token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_the_same_image_twice_hits_the_encoder_cache(
        topo: Topology, client: openai.OpenAI, media_dir: pathlib.Path) -> None:
    (encoder,) = topo.encode_addresses
    path = media_dir / "fresh.png"
    path.write_bytes(png((30, 36, 3), 11))  # an allow-listed local file, new to the encoder
    before = stats(encoder)
    ask(client, topo, "Once.", [str(path)])
    once = stats(encoder)
    assert once.num_encoded_images == before.num_encoded_images + 1
    assert once.encode_cache_size == before.encode_cache_size + 1
    ask(client, topo, "Twice?", [f"file://{path}"])
    twice = stats(encoder)
    assert twice.encode_cache_hits == once.encode_cache_hits + 1
    assert twice.num_encoded_images == once.num_encoded_images


def test_bad_media_is_a_clear_400_and_services_stay_up(
        topo: Topology, client: openai.OpenAI, llava: Llava, hang_url: str) -> None:
    oversize = png((256, 256, 3), 5)
    assert len(oversize) > MAX_FILE_MB * 1024 * 1024
    cases = [
        (data_url(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8), "cannot be decoded|decode"),
        (data_url(oversize), "larger|too large|exceeds"),
        ("/etc/hostname", "outside the allowed media directory"),
        (hang_url, "timed out"),
        (data_url(IMAGES[0], "text/plain"), "expected an image, got content of type 'text/plain'"),
    ]
    for url, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, topo, TEXT, [url])
        assert info.value.status_code == 400
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == "messages[0].content[0]", error
        assert re.search(words, error["message"]), error["message"]
    assert topo.process.poll() is None
    reply = ask(client, topo, TEXT, [data_url(IMAGES[0])])
    assert [e.token for e in reply.choices[0].logprobs.content] == \
        token_texts(llava, llava.greedy(TEXT, IMAGES[:1]))


def generate_public_grpc(topo: Topology, text: str, urls: list[str]) -> list[int]:
    """Inference.Generate on the frontend's public gRPC API, a chat message with image parts."""
    parts = [*(inference_pb2.ContentPart(image_url=u) for u in urls),
             inference_pb2.ContentPart(text=text)]
    request = inference_pb2.InferenceRequest(
        model=topo.model, chat=inference_pb2.ChatInput(
            messages=[inference_pb2.ChatMessage(role="user", parts=parts)]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                           min_tokens=NEW_TOKENS))
    with grpc.insecure_channel(topo.grpc_address) as channel:
        return [t for chunk in inference_pb2_grpc.InferenceStub(channel).Generate(
            request, timeout=60) for t in chunk.token_ids]


def test_images_through_the_public_grpc_api(topo: Topology, llava: Llava) -> None:
    (encoder,) = topo.encode_addresses
    images = [IMAGES[1], png((48, 30, 3), 31)]
    before = stats(encoder).num_encoded_images
    assert generate_public_grpc(topo, TEXT, [data_url(d) for d in images]) == \
        llava.greedy(TEXT, images)
    assert stats(encoder).num_encoded_images > before  # the new image went to the encoder
    with pytest.raises(grpc.RpcError) as info:
        generate_public_grpc(topo, TEXT, [data_url(b"GIF89a" + b"broken" * 4, "image/gif")])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].content[0]" in (info.value.details() or "")
    assert topo.process.poll() is None
