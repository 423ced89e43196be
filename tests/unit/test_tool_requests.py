"""Requests with tools, tool messages, template variables, and the explicit lists of accepted
and refused fields (tandem.frontend.request_fields), kept equal to docs/api/openai.md's."""
from __future__ import annotations

import json
import logging
import pathlib
import re
from typing import Any

import jsonschema
import pytest

from tandem.engines.types import GuidedKind
from tandem.errors import InvalidRequest
from tandem.frontend.openai_request import parse_request
from tandem.frontend.request_fields import IGNORED, REFUSED
from tandem.frontend.tool_request import ToolRequest

ROOT = pathlib.Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "weather?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def tools_of(**fields: Any) -> ToolRequest:
    tools = parse_request(chat(**fields), "chat").tools
    assert tools is not None
    return tools


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat", chat(tools={"a": 1}), "tools", "array"),
    ("chat", chat(tools=[3]), "tools[0]", "object"),
    ("chat", chat(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools[0].type",
     "custom tools are not supported"),
    ("chat", chat(tools=[{"type": "function"}]), "tools[0].function", "object"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": ""}}]),
     "tools[0].function.name", "non-empty"),
    ("chat", chat(tools=[WEATHER, WEATHER]), "tools[1].function.name", "second tool"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "tools[0].function.parameters", "JSON schema object"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "description": 3}}]),
     "tools[0].function.description", "string"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
     "tools[0].function.strict", "boolean"),
    ("chat", chat(tools=[WEATHER], tool_choice="always"), "tool_choice", "'always'"),
    ("chat", chat(tools=[WEATHER], tool_choice=3), "tool_choice", "string or an object"),
    ("chat", chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
     "tool_choice.function.name", "not one of the request's tools"),
    ("chat", chat(tools=[WEATHER], tool_choice={"type": "function"}),
     "tool_choice.function.name", "non-empty string"),
    ("chat", chat(tools=[WEATHER], tool_choice={"type": "allowed_tools", "allowed_tools": {}}),
     "tool_choice.type", "allowed_tools"),
    ("chat", chat(tool_choice="required"), "tool_choice", "needs a non-empty 'tools'"),
    ("chat", chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "tool_choice.function.name", "not one of"),
    ("chat", chat(tools=[WEATHER], parallel_tool_calls="no"), "parallel_tool_calls", "boolean"),
    ("chat", chat(tools=[WEATHER], tool_choice="required",
                  response_format={"type": "json_object"}), "tool_choice", "response_format"),
    ("chat", chat(tools=[WEATHER], guided_regex="a+"), "tool_choice", "structured-output"),
    ("chat", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objec"}}}], tool_choice={
        "type": "function", "function": {"name": "f"}}), "tools[0].function.parameters",
     "not a valid JSON schema"),
    ("chat", chat(messages=[{"role": "tool", "content": "42"}]), "messages[0].tool_call_id",
     "non-empty string"),
    ("chat", chat(messages=[{"role": "assistant", "content": None, "tool_calls": {"a": 1}}]),
     "messages[0].tool_calls", "array"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]),
     "messages[0].tool_calls[0].function.name", "non-empty string"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [{"type": "code"}]}]),
     "messages[0].tool_calls[0].type", "'function'"),
    ("chat", chat(chat_template_kwargs=[1]), "chat_template_kwargs", "object"),
    ("chat", chat(chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools",
     "may not be set"),
    ("chat", chat(reasoning_effort="extreme"), "reasoning_effort", "one of"),
    ("chat", chat(reasoning_effort=1), "reasoning_effort", "string"),
    ("completion", {"model": "m", "prompt": "p", "tools": [WEATHER]}, "tools",
     "/v1/chat/completions only"),
    ("completion", {"model": "m", "prompt": "p", "tool_choice": "auto"}, "tool_choice",
     "chat/completions only"),
    ("completion", {"model": "m", "prompt": "p", "chat_template_kwargs": {"a": 1}},
     "chat_template_kwargs", "chat/completions only"),
]


@pytest.mark.parametrize(("kind", "body", "param", "words"), BAD)
def test_bad_tool_requests_name_the_field(kind: Any, body: dict[str, Any], param: str,
                                          words: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(body, kind)
    assert info.value.param == param
    assert words in info.value.message


def test_tool_choice_defaults_and_shapes() -> None:
    assert parse_request(chat(tools=[]), "chat").tools is None
    assert parse_request(chat(tool_choice="auto"), "chat").tools is None
    auto = tools_of(tools=[WEATHER, TIME])
    assert (auto.choice, auto.function, auto.parallel, auto.is_forced) == ("auto", None, True,
                                                                            False)
    assert auto.template_tools == [WEATHER, {"type": "function", "function": {"name": "get_time"}}]
    assert auto.output_schema() is None
    assert tools_of(tools=[WEATHER], tool_choice="none").choice == "none"
    # none and auto leave the output unconstrained
    assert parse_request(chat(tools=[WEATHER], tool_choice="none"), "chat").guided is None
    named = tools_of(tools=[WEATHER, TIME], parallel_tool_calls=False,
                     tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.function, named.parallel) == ("function", "get_time", False)


def test_named_choice_schema_is_the_call_object() -> None:
    req = parse_request(chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), "chat")
    assert req.guided is not None and req.guided.kind is GuidedKind.JSON_SCHEMA
    schema = json.loads(req.guided.spec)
    good = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
    jsonschema.validate(good, schema)
    for bad in ({"name": "get_time", "arguments": {"city": "Paris"}},
                {"name": "get_weather", "arguments": {"unit": "c"}},
                {"name": "get_weather"}, [good]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_choice_schema_is_an_array_of_calls(parallel: bool) -> None:
    req = parse_request(chat(tools=[WEATHER, TIME], tool_choice="required",
                             parallel_tool_calls=parallel), "chat")
    assert req.guided is not None
    schema = json.loads(req.guided.spec)
    one = [{"name": "get_time", "arguments": {}}]
    two = one + [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    jsonschema.validate(one, schema)
    for bad in ([], [{"name": "nope", "arguments": {}}], {"name": "get_time", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)


def test_forced_functions_are_what_a_forced_choice_may_call() -> None:
    no_parameters = {"type": "object", "properties": {}}
    weather = WEATHER["function"]["parameters"]  # type: ignore[index]
    assert tools_of(tools=[WEATHER, TIME], tool_choice="required").forced_functions() == {
        "get_weather": weather, "get_time": no_parameters}
    assert tools_of(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}).forced_functions() == {
        "get_time": no_parameters}
    for choice in ("auto", "none"):
        assert tools_of(tools=[WEATHER], tool_choice=choice).forced_functions() == {}


def test_calls_from_json() -> None:
    required = tools_of(tools=[WEATHER, TIME], tool_choice="required")
    assert required.calls_from_json(
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": '
        '{"city": "Zürich"}}]') == [("get_time", "{}"), ("get_weather", '{"city": "Zürich"}')]
    named = tools_of(tools=[WEATHER], tool_choice={"type": "function",
                                                   "function": {"name": "get_weather"}})
    assert named.calls_from_json('{"name": "get_weather", "arguments": {"city": "A"}}') == [
        ("get_weather", '{"city": "A"}')]
    for cut in ('{"name": "get_weather", "argu', '[{"name": "get_time", "arguments": {}}',
                '{"name": "get_weather"}'):
        assert named.calls_from_json(cut) is None or cut.startswith("[")
        assert required.calls_from_json(cut) is None


def test_tool_messages_and_template_variables() -> None:
    req = parse_request(chat(
        messages=[*USER,
                  {"role": "assistant", "content": None, "reasoning_content": "hmm",
                   "tool_calls": [{"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}},
                       {"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
                  {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                   "content": [{"type": "text", "text": "18 C"}]}],
        chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"},
        reasoning_effort="high"), "chat")
    assert req.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "hmm",
                               "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}
    assert req.messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1",
                               "name": "get_weather"}
    # the top-level field wins over the kwargs entry of the same name
    assert req.template_variables() == {"enable_thinking": False, "reasoning_effort": "high"}


# --- the explicit lists ----------------------------------------------------------------------


def test_every_refused_field_is_a_400_naming_it_unless_it_asks_for_nothing() -> None:
    asks = {"logit_bias": {"50256": -100}, "audio": {"voice": "alloy", "format": "wav"},
            "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
            "web_search_options": {"search_context_size": "low"}, "store": True, "service_tier": "flex",
            "verbosity": "low", "moderation": {"model": "m"}, "functions": [TIME["function"]],
            "function_call": "auto", "echo": True, "suffix": "end", "best_of": 2,
            "add_generation_prompt": False, "continue_final_message": True,
            "chat_template": "{{ x }}", "documents": [{"text": "d"}],
            "include_stop_str_in_output": True, "prompt_logprobs": 1,
            "truncate_prompt_tokens": 5, "use_beam_search": True, "allowed_token_ids": [1],
            "bad_words": ["x"], "structured_outputs": {"json": {}}, "tools": [WEATHER],
            "tool_choice": "none", "parallel_tool_calls": True,
            "chat_template_kwargs": {"a": 1}, "reasoning_effort": "low"}
    nothing = {"logit_bias": {}, "modalities": ["text"], "store": False, "service_tier": "auto",
               "best_of": 1, "add_generation_prompt": True, "echo": False}
    for refusal in REFUSED:
        for kind in refusal.kinds:
            base = chat() if kind == "chat" else {"model": "m", "prompt": "p"}
            with pytest.raises(InvalidRequest) as info:
                parse_request({**base, refusal.name: asks[refusal.name]}, kind)
            assert info.value.param == refusal.name, refusal.name
            assert f"'{refusal.name}'" in info.value.message
            parse_request({**base, refusal.name: None}, kind)
            if refusal.name in nothing:
                parse_request({**base, refusal.name: nothing[refusal.name]}, kind)


def test_ignored_and_unknown_fields_are_accepted_and_unknown_ones_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    ignored = {"user": "u", "safety_identifier": "s", "metadata": {"k": "v"},
               "prompt_cache_key": "k", "prompt_cache_retention": "24h",
               "prompt_cache_options": {"ttl": "1h"}, "guided_decoding_backend": "xgrammar",
               "guided_whitespace_pattern": " ?"}
    assert set(ignored) == {k for k in IGNORED if "." not in k}
    with caplog.at_level(logging.WARNING, "tandem.frontend.openai_request"):
        parse_request(chat(**ignored, stream=True,
                           stream_options={"include_obfuscation": False}), "chat")
        assert not caplog.records
        parse_request(chat(frobnicate=1, user="u"), "chat")
    assert [r.fields for r in caplog.records] == [["frobnicate"]]  # type: ignore[attr-defined]


def test_readme_lists_exactly_the_ignored_and_refused_fields() -> None:
    readme = (ROOT / "docs" / "api" / "openai.md").read_text(encoding="utf-8")
    section = readme.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    bullets = [" ".join(b.split()) for b in section.split("\n- ")[1:]]
    ignored = next(b for b in bullets if b.startswith("Accepted and ignored:"))
    refused = next(b for b in bullets if b.startswith("Refused"))
    assert set(re.findall(r"`([a-z_.]+)`", ignored)) == set(IGNORED)
    values = {"true", "false", "auto", "default", "n"}  # accepted values, named beside fields
    assert set(re.findall(r"`([a-z_]+)`", refused)) - values == {r.name for r in REFUSED}
