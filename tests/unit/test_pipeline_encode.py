"""The frontend pipeline's encode step: a request with images is routed with has_images and its
block hashes; the router's encode workers are tried in order (a failing one is skipped); their
embeddings replace the images at the images' placeholder positions in what the decode worker
gets; with no encode worker answering, the images themselves go on (the worker encodes them).
Router, encoders and decode worker are scripted stand-ins for the pipeline's ports."""
from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import pytest

from tandem.engines.types import (
    Embedding,
    EngineRequest,
    FinishReason,
    MemoryDescriptor,
    NixlTensorRef,
    SamplingParams,
    TokenChunk,
    Usage,
)
from tandem.errors import Unavailable
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.pipeline import GenerationRequest, Pipeline
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.demo import ensure_demo_model
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef

DECODE = WorkerRef("d", "d", "decode")
ENCODERS = (WorkerRef("e1", "e1", "encode"), WorkerRef("e2", "e2", "encode"))
IMAGES = (Embedding("aa" * 32, (3,), "image/png", b"png-1", 2),
          Embedding("bb" * 32, (3,), "image/png", b"png-2", 6))


def encoded(image: Embedding, hash_: str | None = None) -> Embedding:
    return Embedding(hash_ or image.content_hash, (3, 2), "float32", b"\1" * 24)


class Router:
    def __init__(self, encoders: tuple[WorkerRef, ...]) -> None:
        self.encoders = encoders
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision:
        self.calls.append((tuple(block_hashes), has_images))
        return RouteDecision((DECODE,), encode_workers=self.encoders if has_images else ())

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        pass


class Encoders:
    def __init__(self, answers: dict[str, Exception | list[Embedding]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, list[Embedding]]] = []

    async def encode(self, address: str, request_id: str, images: Sequence[Embedding],
                     timeout_s: float | None = None) -> list[Embedding]:
        self.calls.append((address, list(images)))
        answer = self.answers[address]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Decode:
    def __init__(self) -> None:
        self.requests: list[EngineRequest] = []

    async def generate(self, address: str, request: EngineRequest,
                       timeout_s: float | None = None) -> AsyncGenerator[TokenChunk, None]:
        self.requests.append(request)
        yield TokenChunk([300], [], FinishReason.LENGTH, Usage(10, 1))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model())


async def run(tokenizer: Tokenizer, router: Router, encoders: Encoders,
              images: tuple[Embedding, ...] = IMAGES) -> Decode:
    decode = Decode()
    pipeline = Pipeline(router, decode, lambda req: IncrementalDetokenizer(tokenizer),
                        FrontendMetrics("m"), encode=encoders)
    request = GenerationRequest("r1", list(range(10)), SamplingParams(max_tokens=1),
                                embeddings=images, block_hashes=(7, 8) if images else ())
    [delta] = [d async for d in pipeline.generate(request)]
    assert delta.token_ids == [300]
    return decode


async def test_a_failing_encoder_is_skipped_and_embeddings_take_the_images_places(
        tokenizer: Tokenizer) -> None:
    router = Router(ENCODERS)
    encoders = Encoders({"e1": Unavailable("e1 down"), "e2": [encoded(i) for i in IMAGES]})
    decode = await run(tokenizer, router, encoders)
    assert router.calls == [((7, 8), True)]
    assert [address for address, _ in encoders.calls] == ["e1", "e2"]
    assert encoders.calls[1][1] == list(IMAGES)  # the images themselves go to the encoder
    [request] = decode.requests
    assert [(e.content_hash, e.dtype, e.shape, e.placeholder_offset)
            for e in request.embeddings] == [("aa" * 32, "float32", (3, 2), 2),
                                             ("bb" * 32, "float32", (3, 2), 6)]


@pytest.mark.parametrize("answers", [
    {"e1": Unavailable("down"), "e2": Unavailable("down")},
    # An encoder answering for other images (a different model, a bug) is not trusted.
    {"e1": [encoded(IMAGES[0]), encoded(IMAGES[1], "cc" * 32)], "e2": Unavailable("down")},
], ids=["all-down", "wrong-hash"])
async def test_without_an_answering_encoder_the_images_go_to_the_worker(
        tokenizer: Tokenizer, answers: dict[str, Exception | list[Embedding]]) -> None:
    decode = await run(tokenizer, Router(ENCODERS), Encoders(answers))
    assert decode.requests[0].embeddings == IMAGES


async def test_text_requests_and_deployments_without_encoders_skip_the_encode_step(
        tokenizer: Tokenizer) -> None:
    encoders = Encoders({})
    router = Router(ENCODERS)
    decode = await run(tokenizer, router, encoders, images=())
    assert router.calls == [((), False)] and encoders.calls == []
    assert decode.requests[0].embeddings == ()
    decode = await run(tokenizer, Router(()), encoders)
    assert encoders.calls == [] and decode.requests[0].embeddings == IMAGES


async def test_a_text_only_model_refuses_images(tokenizer: Tokenizer) -> None:
    from tandem.errors import InvalidRequest
    from tandem.frontend.frontend import Frontend, ModelInfo
    from tandem.frontend.openai_request import parse_request

    frontend = Frontend(ModelInfo("demo", 512), tokenizer, Pipeline(
        Router(()), Decode(), lambda req: IncrementalDetokenizer(tokenizer),
        FrontendMetrics("demo")))
    parsed = parse_request({"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "chat")
    with pytest.raises(InvalidRequest, match="model 'demo' does not accept images") as info:
        await frontend.prepare(parsed)
    assert info.value.param == "messages[0].content[1]"


@pytest.mark.parametrize("item", [
    IMAGES[0],
    Embedding("cc" * 32, (3, 2), "bfloat16", b"\7" * 12, 5),
    Embedding("dd" * 32, (9, 64), "float16", NixlTensorRef(
        "encode-0", b"agent-md", MemoryDescriptor(4096, 1152, 0), "DRAM"), 17),
], ids=["image", "raw", "nixl"])
def test_multimodal_items_round_trip_through_protobuf(item: Embedding) -> None:
    from tandem.runtime import convert

    msg = convert.embedding_to_pb(item)
    assert msg.WhichOneof("data") == ("nixl" if isinstance(item.data, NixlTensorRef) else "raw")
    assert convert.embedding_from_pb(msg) == item
