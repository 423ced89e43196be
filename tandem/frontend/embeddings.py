"""OpenAI's embeddings API (`POST /v1/embeddings`) over an embedding model's workers: the body
as an EmbeddingRequest, the inputs tokenized here (texts with the tokenizer's special tokens, as
sentence-transformers encodes them; token arrays checked against the vocabulary and the
context), sent to the embedding worker the router picks (the next one when it is busy or
gone), and the answer in OpenAI's shape: floats, or base64 of little-endian float32 (what the
official clients ask for by default and decode).
"""
from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tandem.errors import InvalidRequest, Overloaded, TandemError, Unavailable
from tandem.frontend.json_fields import get_int, get_str, is_int, must
from tandem.frontend.tokenizer import Tokenizer
from tandem.routing.workers import WorkerRef
from tandem.runtime.clients import Embeddings

#: Most inputs in one request (OpenAI's limit).
MAX_INPUTS = 2048
_FORMATS = ("float", "base64")
_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    #: One per input: a text, or its token ids.
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    #: Matryoshka truncation; None: the model's whole embedding.
    dimensions: int | None = None


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """Raises InvalidRequest naming the field: an unknown one, a missing or empty input, more
    than MAX_INPUTS inputs, a bad encoding_format or dimensions."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field '{unknown[0]}' for /v1/embeddings", param=unknown[0])
    model = get_str(body, "model")
    if not model:
        raise InvalidRequest("'model' is required", param="model")
    encoding_format = get_str(body, "encoding_format") or "float"
    if encoding_format not in _FORMATS:
        raise InvalidRequest(f"'encoding_format' must be one of {', '.join(_FORMATS)}, got "
                             f"{encoding_format!r}", param="encoding_format")
    return EmbeddingRequest(model, _inputs(body.get("input")), encoding_format,
                            get_int(body, "dimensions", lo=1))


def _inputs(value: object) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(is_int(v) for v in value):
        value = [value]  # one input as token ids
    if not isinstance(value, list) or not value:
        raise must("input", "a string, an array of strings, or token arrays", value)
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(f"'input' holds at most {MAX_INPUTS} inputs, got {len(value)}",
                             param="input")
    inputs: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            inputs.append(item)
        elif isinstance(item, list) and all(is_int(t) and t >= 0 for t in item):
            inputs.append(tuple(item))
        else:
            raise must(f"input[{i}]", "a string or an array of token ids", item)
        if not item:
            raise InvalidRequest(f"'input[{i}]' must not be empty", param=f"input[{i}]")
    return tuple(inputs)


def embedding_response(model: str, result: Embeddings, encoding_format: str) -> dict[str, Any]:
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(vector, encoding_format)}
                     for i, vector in enumerate(result.vectors)],
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "total_tokens": result.prompt_tokens}}


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


class EmbedRouter(Protocol):
    async def route_embedding(self, request_id: str, exclude_ids: tuple[str, ...] = ()
                              ) -> tuple[WorkerRef, ...]: ...

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None: ...


class EmbedWorkers(Protocol):
    async def embed(self, address: str, request_id: str, inputs: Sequence[Sequence[int]],
                    dimensions: int | None, timeout_s: float | None = None) -> Embeddings: ...


class Embedder:
    """One embedding model's requests: tokenize, route, call a worker."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, router: EmbedRouter,
                 workers: EmbedWorkers,
                 check_dimensions: Callable[[int | None], None] = lambda _: None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.router = router
        self.workers = workers
        #: Raises InvalidRequest(param="dimensions") for a size the model cannot give (the
        #: workers check it too, but a param does not survive the gRPC hop).
        self.check_dimensions = check_dimensions

    async def token_ids(self, inputs: Sequence[str | tuple[int, ...]]) -> list[list[int]]:
        """Each input's tokens. Raises InvalidRequest naming `input[i]` for a token outside
        the vocabulary or an input longer than the model's context."""
        out: list[list[int]] = []
        vocab = self.tokenizer.vocab_size
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                ids = await self.tokenizer.encode_off_loop(item, add_special_tokens=True)
            else:
                ids = list(item)
                bad = next((t for t in ids if t >= vocab), None)
                if bad is not None:
                    raise InvalidRequest(f"'input[{i}]' holds token id {bad}, outside the "
                                         f"vocabulary (size {vocab})", param=f"input[{i}]")
            if len(ids) > self.max_model_len:
                raise InvalidRequest(f"'input[{i}]' has {len(ids)} tokens; this model's context "
                                     f"is {self.max_model_len}", param=f"input[{i}]")
            out.append(ids)
        return out

    async def embed(self, req: EmbeddingRequest, timeout_s: float | None = None) -> Embeddings:
        """The request's embeddings from an embedding worker; a worker that is busy or gone
        hands the request to the router's next pick.

        Raises:
            InvalidRequest: inputs the model cannot take (see token_ids), or `dimensions` it
                cannot give.
            Unavailable: no embedding worker can take it.
        """
        self.check_dimensions(req.dimensions)
        inputs = await self.token_ids(req.inputs)
        request_id = uuid.uuid4().hex
        tried: list[str] = []
        busy: TandemError | None = None
        while True:
            try:
                workers = await self.router.route_embedding(request_id, tuple(tried))
            except Unavailable:
                raise busy or Unavailable("no embedding worker is available") from None
            pick = workers[0]
            outcome = "error"
            try:
                result = await self.workers.embed(pick.address, request_id, inputs,
                                                  req.dimensions, timeout_s)
                outcome = "ok"
                return result
            except (Overloaded, Unavailable) as exc:  # draining, gone: the next one
                busy, tried = exc, [*tried, pick.worker_id]
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self.router.report_completion(request_id, outcome, 0)
