"""The Anthropic Messages API end to end: the official `anthropic` client against `tandem up
--engine reference --tool-call-parser hermes` on a tiny random-weights Llama with Qwen2.5's
chat template. Random weights write gibberish, so the tests check structure: message shapes, a
forced tool_use that validates against its schema and a tool_result answered, the stream's
documented event order, count_tokens equal to the usage, and errors in Anthropic's shape."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest
import requests

from tests.e2e.tiny_tools import start_tools_topology
from tests.e2e.topology import Topology

GREEDY: dict[str, Any] = {"temperature": 0}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city"]}
RAW_EVENTS = frozenset({"message_start", "content_block_start", "content_block_delta",
                        "content_block_stop", "message_delta", "message_stop"})
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    topo = start_tools_topology(tmp_path_factory.mktemp("tiny") / "tiny-anthropic")
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=topo.http_url, api_key="unused", max_retries=0)


def test_text_message(client: anthropic.Anthropic, topo: Topology) -> None:
    message = client.messages.create(model=topo.model, max_tokens=12, messages=MESSAGES,
                                     system="Be brief.", extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == topo.model
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 12 and message.usage.input_tokens > 0
    again = client.messages.create(model=topo.model, max_tokens=12, messages=MESSAGES,
                                   system="Be brief.", extra_body=GREEDY)
    assert again.content == message.content  # greedy: the same tokens


def test_forced_tool_round_trip(client: anthropic.Anthropic, topo: Topology) -> None:
    message = client.messages.create(model=topo.model, max_tokens=100, messages=MESSAGES,
                                     tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     extra_body=GREEDY)
    assert message.stop_reason == "tool_use", message
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER)
    follow_up = client.messages.create(
        model=topo.model, max_tokens=8, tools=TOOLS, tool_choice={"type": "none"},
        messages=[*MESSAGES, {"role": "assistant", "content": message.content},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": calls[0].id,
                                                "content": "Sunny, 21 C"}]}],
        extra_body=GREEDY)
    assert follow_up.content and follow_up.content[0].type == "text"
    assert follow_up.stop_reason in ("end_turn", "max_tokens")


def test_stream_follows_the_documented_order(client: anthropic.Anthropic,
                                             topo: Topology) -> None:
    with client.messages.stream(model=topo.model, max_tokens=16, messages=MESSAGES,
                                extra_body=GREEDY) as stream:
        # The client adds derived events ("text", "input_json", ...); keep the wire ones.
        names = [event.type for event in stream if event.type in RAW_EVENTS]
        final = stream.get_final_message()
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    body, i = names[1:-2], 0
    assert body
    while i < len(body):
        assert body[i] == "content_block_start", names
        i += 1
        while body[i] == "content_block_delta":
            i += 1
        assert body[i] == "content_block_stop", names
        i += 1
    plain = client.messages.create(model=topo.model, max_tokens=16, messages=MESSAGES,
                                   extra_body=GREEDY)
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "text", None)) for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_stream_of_a_forced_tool_call(client: anthropic.Anthropic, topo: Topology) -> None:
    with client.messages.stream(model=topo.model, max_tokens=100, messages=MESSAGES,
                                tools=TOOLS, tool_choice={"type": "any"},
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    for block in final.content:
        assert block.type == "tool_use"
        jsonschema.validate(block.input, WEATHER)


def test_count_tokens_equals_the_usage(client: anthropic.Anthropic, topo: Topology) -> None:
    kwargs: dict[str, Any] = {"model": topo.model, "messages": MESSAGES, "system": "Be brief.",
                              "tools": TOOLS, "tool_choice": {"type": "any"}}
    counted = client.messages.count_tokens(**kwargs)
    message = client.messages.create(max_tokens=4, extra_body=GREEDY, **kwargs)
    assert counted.input_tokens == message.usage.input_tokens > 0
    plain = client.messages.count_tokens(model=topo.model, messages=MESSAGES)
    assert plain.input_tokens < counted.input_tokens  # the tools are in the prompt


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, topo: Topology) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)
    body = missing.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert "no-such-model" in body["error"]["message"]
    url = topo.http_url + "/v1/messages"
    answer = requests.post(url, json={"model": topo.model, "messages": MESSAGES}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=topo.model, max_tokens=4, messages=MESSAGES,
                               extra_body={"frequency_penalty": 1})
    assert "frequency_penalty" in str(bad.value)
    with pytest.raises(anthropic.BadRequestError) as thinking:
        client.messages.create(model=topo.model, max_tokens=2000, messages=MESSAGES,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in str(thinking.value)  # no --reasoning-parser here
    unknown = requests.get(topo.http_url + "/v1/messages/nothing", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"
    # The service is still up.
    assert client.messages.create(model=topo.model, max_tokens=2, messages=MESSAGES).content
