"""Structured-output fields of OpenAI requests (response_format, vLLM's guided_*, Dynamo's
nvext.guided_*) become one GuidedDecoding constraint, checked by compiling it; the constraint
survives the wire both ways."""
from __future__ import annotations

import json

import pytest

from services.frontend.inference import openai_body
from tandem.engines.types import GuidedDecoding, GuidedKind
from tandem.errors import InvalidRequest
from tandem.frontend.openai_request import parse_request
from tandem.runtime import convert
from tandem.v1 import common_pb2, inference_pb2

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def guided(**fields: object) -> GuidedDecoding | None:
    return parse_request(chat(**fields), "chat").guided


def test_no_constraint_and_text_format_leave_the_output_free() -> None:
    assert guided() is None
    assert guided(response_format={"type": "text"}) is None


@pytest.mark.parametrize("fields, kind, spec, choices", [
    ({"response_format": {"type": "json_object"}}, GuidedKind.JSON_OBJECT, "", ()),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA, "strict": True}}}, GuidedKind.JSON_SCHEMA, SCHEMA, ()),
    ({"guided_json": SCHEMA}, GuidedKind.JSON_SCHEMA, SCHEMA, ()),
    ({"guided_json": json.dumps(SCHEMA)}, GuidedKind.JSON_SCHEMA, SCHEMA, ()),
    ({"nvext": {"guided_json": SCHEMA}}, GuidedKind.JSON_SCHEMA, SCHEMA, ()),
    ({"guided_regex": "[0-9]{3}"}, GuidedKind.REGEX, "[0-9]{3}", ()),
    ({"nvext": {"guided_regex": "a+"}}, GuidedKind.REGEX, "a+", ()),
    ({"guided_choice": ["yes", "no"]}, GuidedKind.CHOICE, "", ("yes", "no")),
    ({"nvext": {"guided_choice": ["x"]}}, GuidedKind.CHOICE, "", ("x",)),
    ({"guided_grammar": 'root ::= "a" | "b"'}, GuidedKind.GRAMMAR, 'root ::= "a" | "b"', ()),
    ({"nvext": {"guided_grammar": 'root ::= "c"', "guided_decoding_backend": "xgrammar"}},
     GuidedKind.GRAMMAR, 'root ::= "c"', ()),
])
def test_each_field_becomes_its_constraint(fields: dict[str, object], kind: GuidedKind,
                                           spec: object, choices: tuple[str, ...]) -> None:
    result = guided(**fields)
    assert result is not None and result.kind is kind and result.choices == choices
    assert (json.loads(result.spec) if kind is GuidedKind.JSON_SCHEMA else result.spec) == spec
    # It reaches the engine inside the sampling parameters, completions included.
    body = {"model": "m", "prompt": "hi", **fields}
    assert parse_request(body, "completion").sampling(8).guided == result


@pytest.mark.parametrize("fields, names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     ("'response_format'", "'guided_regex'")),
    ({"guided_choice": ["a"], "nvext": {"guided_choice": ["b"]}},
     ("'guided_choice'", "'nvext.guided_choice'")),
    ({"guided_json": SCHEMA, "guided_grammar": 'root ::= "a"'},
     ("'guided_json'", "'guided_grammar'")),
])
def test_two_constraints_are_refused_naming_both(fields: dict[str, object],
                                                 names: tuple[str, str]) -> None:
    with pytest.raises(InvalidRequest) as info:
        guided(**fields)
    assert all(name in info.value.message for name in names)
    assert info.value.param == names[1].strip("'")


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "objec"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"nvext": {"guided_grammar": "root ::= undefined_rule"}}, "nvext.guided_grammar"),
    ({"guided_grammar": 'start ::= "a"'}, "guided_grammar"),  # no root rule
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA, "strict": "yes"}}}, "response_format.json_schema.strict"),
])
def test_bad_constraints_are_refused_naming_the_field(fields: dict[str, object],
                                                      param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        guided(**fields)
    assert info.value.param == param


@pytest.mark.parametrize("value", [
    GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA), num_output_tokens_in_prompt=7),
    GuidedDecoding(GuidedKind.JSON_OBJECT),
    GuidedDecoding(GuidedKind.JSON_OBJECT, json_whitespace=8),
    GuidedDecoding(GuidedKind.REGEX, "[a-z]+"),
    GuidedDecoding(GuidedKind.CHOICE, choices=("a", "b\"c")),
    GuidedDecoding(GuidedKind.GRAMMAR, 'root ::= "x"', num_output_tokens_in_prompt=1),
])
def test_the_constraint_survives_the_wire(value: GuidedDecoding) -> None:
    from tandem.engines.types import SamplingParams

    params = SamplingParams(max_tokens=4, guided=value)
    wire = common_pb2.SamplingParams.FromString(
        convert.sampling_to_pb(params).SerializeToString())
    assert convert.sampling_from_pb(wire, 16) == params
    assert convert.sampling_from_pb(common_pb2.SamplingParams(), 16).guided is None


async def test_json_whitespace_is_the_frontends_choice_for_json_constraints() -> None:
    from typing import cast

    from tandem.frontend.frontend import Frontend, ModelInfo
    from tandem.frontend.pipeline import Pipeline
    from tandem.frontend.tokenizer import Tokenizer
    from tandem.model.demo import ensure_demo_model

    tokenizer = Tokenizer.from_dir(ensure_demo_model())
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    for json_whitespace in (0, 4):
        frontend = Frontend(ModelInfo("demo", 4096), tokenizer, cast(Pipeline, None),
                            json_whitespace=json_whitespace)
        for extra, expected in (({"response_format": {"type": "json_object"}}, json_whitespace),
                                ({"guided_regex": "[a-z]+"}, 0)):
            prepared = await frontend.prepare(parse_request({**chat, **extra}, "chat"))
            assert prepared.sampling.guided is not None
            assert prepared.sampling.guided.json_whitespace == expected
    with pytest.raises(InvalidRequest) as info:
        convert.guided_from_pb(common_pb2.GuidedDecoding(json_object=True, json_whitespace=65))
    assert info.value.param == "guided_decoding.json_whitespace"


@pytest.mark.parametrize("msg", [common_pb2.GuidedDecoding(),
                                 common_pb2.GuidedDecoding(json_object=False),
                                 common_pb2.GuidedDecoding(regex=""),
                                 common_pb2.GuidedDecoding(choice=common_pb2.ChoiceList())])
def test_an_empty_constraint_on_the_wire_is_refused(msg: common_pb2.GuidedDecoding) -> None:
    with pytest.raises(InvalidRequest):
        convert.sampling_from_pb(common_pb2.SamplingParams(guided_decoding=msg), 16)


def test_the_public_grpc_api_takes_the_same_constraints() -> None:
    request = inference_pb2.InferenceRequest(model="m", prompt="hi")
    request.sampling.guided_decoding.choice.choices.extend(["a", "b"])
    body, kind = openai_body(request)
    assert parse_request(body, kind).guided == GuidedDecoding(GuidedKind.CHOICE,
                                                              choices=("a", "b"))
    request.sampling.guided_decoding.regex = "a("
    with pytest.raises(InvalidRequest) as info:
        parse_request(*openai_body(request))
    assert info.value.param == "guided_regex"
