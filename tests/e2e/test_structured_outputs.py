"""Structured outputs end to end: the official `openai` client against `tandem up --engine
reference` on a tiny random-weights Llama. Whatever the weights, every answer that finishes
with "stop" satisfies its constraint (JSON schemas, regex, choice, JSON object), and bad or
doubled constraints are 400s naming the field. max_tokens is generous: an answer cut by
max_tokens finishes "length" with its output incomplete, as OpenAI's does."""
from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.e2e.topology import Topology, start_topology

MAX_TOKENS = 300
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
        "required": ["name", "age", "address"]},
    "enum_array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "minItems": 1, "maxItems": 3}}, "required": ["color", "tags"]},
    "any_of": {"type": "object", "properties": {
        "v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}},
        "required": ["v"]},
}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    from tandem.model.tiny import write_tiny_model

    model: pathlib.Path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama",
                                           "llama", seed=0)
    topo = start_topology("--engine", "reference", "--model", str(model), "--device", "cpu",
                          "--kv-block-size", "32", "--num-gpu-blocks-override", "256")
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, seed: int, **kwargs: object) -> tuple[str, str | None]:
    reply = client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=MESSAGES, max_tokens=MAX_TOKENS, seed=seed,
                                           **kwargs)  # type: ignore[call-overload]
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_parse_and_validate(client: openai.OpenAI, name: str) -> None:
    response_format = {"type": "json_schema",
                       "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    for seed in range(3):
        text, finish = ask(client, seed, response_format=response_format)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_a_small_object_with_bounded_strings_finishes_within_64_tokens(
        client: openai.OpenAI) -> None:
    # Compact JSON by default (--json-whitespace 0): a random model cannot spend max_tokens on
    # newlines between keys, nor on digits (numbers end within an int64's digits).
    small = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "age": {"type": "integer"}},
             "required": ["name", "age"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "small", "schema": small}}
    for seed in range(5):
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=64, seed=seed,
            response_format=response_format)  # type: ignore[call-overload]
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert reply.usage is not None and reply.usage.completion_tokens <= 64
        jsonschema.validate(json.loads(choice.message.content or ""), small)


def test_a_streamed_json_schema_answer_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=MAX_TOKENS,
        seed=7, stream=True, extra_body={"guided_json": SCHEMAS["enum_array"]})
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMAS["enum_array"])


def test_regex_choice_and_grammar_hold(client: openai.OpenAI) -> None:
    pattern = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
    choices = ["sunny", "rainy", "cloudy"]
    for seed in range(2):
        text, finish = ask(client, seed, extra_body={"guided_regex": pattern})
        assert finish == "stop" and re.fullmatch(pattern, text), text
        text, finish = ask(client, seed, extra_body={"nvext": {"guided_choice": choices}})
        assert finish == "stop" and text in choices, text
        text, finish = ask(client, seed, extra_body={
            "guided_grammar": 'root ::= ("yes" | "no") " " [0-9]'})
        assert finish == "stop" and re.fullmatch(r"(yes|no) [0-9]", text), text
    completion = client.completions.create(model=client.models.list().data[0].id, prompt="Id:",
                                           max_tokens=20, extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", completion.choices[0].text)


def test_json_object_answers_are_objects(client: openai.OpenAI) -> None:
    # An object's strings are unbounded, so a random model may run to max_tokens ("length");
    # every answer that completes is an object.
    finished = 0
    for seed in range(6):
        text, finish = ask(client, seed, response_format={"type": "json_object"})
        if finish == "stop":
            finished += 1
            assert isinstance(json.loads(text), dict), text
        else:
            assert finish == "length" and text.startswith("{")
    assert finished


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
    ({"extra_body": {"nvext": {"guided_grammar": "root ::= missing"}}}, "nvext.guided_grammar"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
     "guided_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI,
                                                   kwargs: dict[str, object],
                                                   param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, 0, **kwargs)
    assert info.value.status_code == 400
    assert info.value.param == param  # type: ignore[attr-defined]
    if "guided_choice" in param:
        assert "'response_format'" in str(info.value) and "'guided_choice'" in str(info.value)
