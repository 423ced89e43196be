"""Responses request -> chat request: what each field becomes, what is refused, and errors that
name the Responses field (not the chat field it was translated to)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.responses_request import (
    ResponsesRequest,
    conversation,
    parse_chat,
    parse_responses,
)
from tandem.frontend.responses_store import ResponseStore, StoredResponse

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}


def no_history(response_id: str) -> list[dict[str, Any]]:
    raise AssertionError("no previous_response_id expected")


def parse(**body: Any) -> ResponsesRequest:
    return parse_responses({"model": "m", **body}, no_history)


def param_of(**body: Any) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(parse(**body))
    return info.value.param


def test_string_input_is_one_user_message_after_instructions() -> None:
    req = parse(input="hi", instructions="be brief")
    assert req.chat_body["messages"] == [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hi"}]
    assert req.input_items == [{"type": "message", "role": "user", "content": "hi"}]
    assert req.store and not req.stream
    assert req.echo["instructions"] == "be brief" and req.echo["tool_choice"] == "auto"


def test_items_become_messages_calls_and_tool_results() -> None:
    req = parse(input=[
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "42"}]},
    ])
    messages = req.chat_body["messages"]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert messages[4]["content"] == "42"
    parsed = parse_chat(req)
    assert parsed.messages[2]["tool_calls"][1]["function"]["arguments"] == {"x": 1}


def test_assistant_output_message_takes_the_calls_that_follow_it() -> None:
    req = parse(input=[
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
    messages = req.chat_body["messages"]
    assert len(messages) == 2 and messages[1]["tool_calls"][0]["id"] == "c1"


def test_settings_translate_to_chat_fields() -> None:
    req = parse(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=32, temperature=0, top_p=0.5, parallel_tool_calls=False,
                reasoning={"effort": "low", "summary": "auto"}, metadata={"k": "v"})
    chat = req.chat_body
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": WEATHER["parameters"],
        "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (32, 0, 0.5)
    assert chat["parallel_tool_calls"] is False and chat["reasoning_effort"] == "low"
    assert req.echo["metadata"] == {"k": "v"} and req.echo["tools"] == [WEATHER]
    parsed = parse_chat(req)
    assert parsed.tools is not None and parsed.tools.choice == "function"
    assert parsed.max_tokens == 32 and parsed.guided is not None


def test_text_format_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse(input="x", text={"format": {"type": "json_schema", "name": "s", "schema": schema,
                                            "strict": True}})
    assert req.chat_body["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    assert json.loads(parse_chat(req).guided.spec) == schema  # type: ignore[union-attr]
    assert parse(input="x", text={"format": {"type": "json_object"}}).chat_body[
        "response_format"] == {"type": "json_object"}
    assert parse(input="x", text={"format": {"type": "text"}}).chat_body[
        "response_format"] == {"type": "text"}


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"mode": "pro"}}, "reasoning.mode"),
    ({"metadata": {"k": 1}}, "metadata"),
])
def test_unsupported_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(input="x", **body)
    assert info.value.param == param


def test_off_values_of_refused_fields_are_accepted() -> None:
    parse(input="x", background=False, truncation="disabled", include=[], top_logprobs=0,
          user="u", service_tier="auto", store=False)


@pytest.mark.parametrize(("input_items", "param"), [
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
     "input[0].content[0].type"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([], "input"),
])
def test_bad_input_items_are_named(input_items: list[Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(input=input_items)
    assert info.value.param == param


def test_chat_errors_name_the_responses_fields() -> None:
    assert param_of(input="x", max_output_tokens=0) == "max_output_tokens"
    assert param_of(input=[{"role": "user", "content": "q"},
                           {"type": "function_call", "call_id": "c", "name": "f",
                            "arguments": "{not json"}]) == "input[1].arguments"
    assert param_of(input="x", tools=[WEATHER],
                    tool_choice={"type": "function", "name": "other"}) == "tool_choice.name"
    assert param_of(input="x", tools=[{**WEATHER, "parameters": [1]}]) == "tools[0].parameters"
    assert param_of(input="x", text={"format": {"type": "json_schema", "schema": {}}}) == (
        "text.format.name")
    assert param_of(input="x", reasoning={"effort": "huge"}) == "reasoning.effort"
    assert param_of(input="x", temperature=5) == "temperature"
    with pytest.raises(InvalidRequest) as info:
        parse_chat(parse(input="x", max_output_tokens=0))
    assert "'max_output_tokens'" in info.value.message


def test_previous_response_prepends_its_conversation() -> None:
    store = ResponseStore(4)
    first = parse_responses({"model": "m", "input": "q1", "instructions": "sys"}, store.history)
    output = [{"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f",
               "arguments": "{}", "status": "completed"}]
    store.put(StoredResponse({"id": "resp_1", "output": output}, list(conversation(first))))
    second = parse_responses({"model": "m", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, store.history)
    roles = [m["role"] for m in second.chat_body["messages"]]
    assert roles == ["user", "assistant", "tool"]  # instructions are not carried over
    assert conversation(second) == [*conversation(first), *output, *second.input_items]
    assert second.echo["previous_response_id"] == "resp_1"
    bad = {"model": "m", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": 5}]}
    with pytest.raises(InvalidRequest) as info:
        parse_responses(bad, store.history)
    assert info.value.param == "input[0].output"


def test_unknown_previous_response_is_a_400_naming_it() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_responses({"model": "m", "input": "x", "previous_response_id": "resp_nope"},
                        ResponseStore(4).history)
    assert info.value.param == "previous_response_id"
