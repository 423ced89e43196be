"""/v1/embeddings bodies: every input shape OpenAI accepts, each refusal naming its field, and
the answer in OpenAI's shape (base64: little-endian float32, as the official clients decode)."""
from __future__ import annotations

import base64
import struct

import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.embeddings import (
    MAX_INPUTS,
    EmbeddingRequest,
    embedding_response,
    parse_embedding_request,
)
from tandem.runtime.clients import Embeddings


@pytest.mark.parametrize("value, inputs", [
    ("hello", ("hello",)),
    (["a", "b c"], ("a", "b c")),
    ([5, 6, 7], ((5, 6, 7),)),
    ([[5, 6], [7]], ((5, 6), (7,))),
    (["a", [5]], ("a", (5,))),
])
def test_every_input_shape_is_read(value: object, inputs: tuple[object, ...]) -> None:
    req = parse_embedding_request({"model": "m", "input": value, "dimensions": 8,
                                   "encoding_format": "base64", "user": "u"})
    assert req == EmbeddingRequest("m", inputs, "base64", 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ""}, "input[0]"),
    ({"model": "m", "input": ["a", []]}, "input[1]"),
    ({"model": "m", "input": [[1, -2]]}, "input[0]"),
    ({"model": "m", "input": [{"text": "a"}]}, "input[0]"),
    ({"model": "m", "input": ["a"] * (MAX_INPUTS + 1)}, "input"),
    ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "m", "input": "a", "dimensions": 0}, "dimensions"),
    ({"model": "m", "input": "a", "truncate": True}, "truncate"),
])
def test_bad_bodies_are_refused_naming_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_embedding_request(body)
    assert info.value.param == param


def test_the_answer_has_openais_shape_in_both_encodings() -> None:
    result = Embeddings([[0.5, -1.25], [3.0, 0.0]], 7)
    floats = embedding_response("m", result, "float")
    assert floats == {"object": "list", "model": "m", "usage": {"prompt_tokens": 7,
                                                                "total_tokens": 7},
                      "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -1.25]},
                               {"object": "embedding", "index": 1, "embedding": [3.0, 0.0]}]}
    packed = embedding_response("m", result, "base64")["data"][1]["embedding"]
    assert struct.unpack("<2f", base64.b64decode(packed)) == (3.0, 0.0)
