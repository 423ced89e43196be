"""Anthropic Messages bodies -> Chat Completions bodies: every mapped field, every refusal naming
the Anthropic field, and errors of the chat parser renamed back to Anthropic's paths."""
from __future__ import annotations

from typing import Any

import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.anthropic_request import check_deployment, translate

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(value: dict[str, Any], param: str, count_only: bool = False) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        request = translate(value, count_only=count_only)
        request.parse({})
    assert info.value.param == param, info.value.message
    assert param in info.value.message
    return info.value


def test_plain_fields_map_to_chat() -> None:
    chat = translate(body(system="be brief", temperature=0, top_p=0.5, top_k=3,
                          stop_sequences=["END"], stream=True,
                          metadata={"user_id": "u"})).chat_body
    assert chat == {"model": "m", "max_tokens": 16, "stream": True, "temperature": 0,
                    "top_p": 0.5, "top_k": 3, "stop": ["END"],
                    "messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    parsed = translate(body()).parse({})
    assert parsed.max_tokens == 16 and parsed.kind == "chat"


def test_blocks_images_and_a_tool_round_trip() -> None:
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "and?"}]}]
    chat = translate(body(messages=messages, system=[{"type": "text", "text": "a"},
                                                     {"type": "text", "text": "b"}])).chat_body
    out = chat["messages"]
    assert out[0] == {"role": "system", "content": "a\nb"}
    assert out[1]["content"][1] == {"type": "image_url",
                                    "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert out[1]["content"][2]["image_url"]["url"] == "https://x/y.png"
    assert out[2] == {"role": "assistant", "content": "calling", "reasoning_content": "hmm",
                      "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                          "name": "weather", "arguments": {"city": "Oslo"}}}]}
    assert out[3] == {"role": "tool", "content": "cold", "tool_call_id": "toolu_1",
                      "name": "weather"}
    assert out[4]["content"] == "Error: timeout"
    assert out[5] == {"role": "user", "content": [{"type": "text", "text": "and?"}]}
    parsed = translate(body(messages=messages)).parse({})
    assert len(parsed.images) == 2


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    (None, "auto", True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ({"type": "any"}, "required", True),
    ({"type": "tool", "name": "weather"}, "function", True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice(choice: Any, expected: str, parallel: bool) -> None:
    tools = [{"name": "weather", "description": "d", "input_schema": WEATHER,
              "cache_control": {"type": "ephemeral"}}]
    parsed = translate(body(tools=tools, tool_choice=choice)).parse({})
    assert parsed.tools is not None
    assert parsed.tools.choice == expected and parsed.tools.parallel is parallel
    assert parsed.tools.template_tools == [{"type": "function", "function": {
        "name": "weather", "description": "d", "parameters": WEATHER}}]
    assert (parsed.guided is not None) == (expected in ("required", "function"))


def test_thinking_and_output_config() -> None:
    request = translate(body(max_tokens=100, thinking={"type": "enabled", "budget_tokens": 50}))
    assert request.thinking == "enabled"
    assert request.chat_body["chat_template_kwargs"] == {"enable_thinking": True}
    assert translate(body(thinking={"type": "disabled"})).chat_body[
        "chat_template_kwargs"] == {"enable_thinking": False}
    parsed = translate(body(output_config={"format": {"type": "json_schema",
                                                      "schema": WEATHER}})).parse({})
    assert parsed.guided is not None
    with pytest.raises(InvalidRequest) as info:
        check_deployment(request, request.parse({}), has_reasoning_parser=False,
                         has_tool_parser=True)
    assert info.value.param == "thinking"
    check_deployment(request, request.parse({}), has_reasoning_parser=True,
                     has_tool_parser=False)


def test_auto_tools_need_a_parser() -> None:
    request = translate(body(tools=[{"name": "w", "input_schema": WEATHER}]))
    with pytest.raises(InvalidRequest) as info:
        check_deployment(request, request.parse({}), has_reasoning_parser=False,
                         has_tool_parser=False)
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"container": "c"}, "container"),
    ({"mcp_servers": [{}]}, "mcp_servers"),
    ({"speed": "fast"}, "speed"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"task_budget": 1}}, "output_config.task_budget"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "w", "input_schema": WEATHER, "defer_loading": True}]},
     "tools[0].defer_loading"),
    ({"tools": [{"name": "w", "input_schema": 3}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "w", "input_schema": {"type": "bogus"}}],
      "tool_choice": {"type": "tool", "name": "w"}}, "tools[0].input_schema"),
    ({"tools": [{"name": "w", "input_schema": WEATHER}],
      "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages[1].role"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "z": 1}]}]},
     "messages[0].content[0].z"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
])
def test_refusals_name_the_anthropic_field(fields: dict[str, Any], param: str) -> None:
    refused({k: v for k, v in body(**fields).items() if v is not None}, param)


def test_chat_errors_are_renamed() -> None:
    # The system message shifts the chat indices by one; the error names the client's path.
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "", "input": {}}]},
        {"role": "user", "content": "y"}]
    error = refused(body(system="s", messages=messages), "messages[1].content[0].name")
    assert "tool_calls" not in error.message


def test_count_tokens_needs_no_max_tokens() -> None:
    request = translate({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                        count_only=True)
    assert "max_tokens" not in request.chat_body
    assert request.parse({}).max_tokens is None


def test_x_api_key_authenticates_as_bearer_does() -> None:
    from tandem.errors import Unauthenticated
    from tandem.frontend.auth import ApiKeys

    keys = ApiKeys(["k1"])
    keys.check(None, "k1")
    keys.check("Bearer k1", None)
    for authorization, api_key in ((None, "k2"), (None, None), ("Bearer k2", "k1")):
        with pytest.raises(Unauthenticated):
            keys.check(authorization, api_key)
