"""Tool calls end to end: the official `openai` client against `tandem up --engine reference
--tool-call-parser hermes` on a tiny random-weights Llama whose chat template renders tools
(Qwen2.5's). A forced tool_choice (named, required) is enforced by a JSON grammar, so whatever
the weights, every answer that finishes is calls whose arguments validate against their tool's
schema; streamed calls assemble to the same calls; a conversation carries a call and its result
back; every refused field is a 400 naming it and the service stays up."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from tandem.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.tiny_tools import start_tools_topology
from tests.e2e.topology import Topology

MAX_TOKENS = 200
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
               "required": ["tz"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    topo = start_tools_topology(tmp_path_factory.mktemp("tiny") / "tiny-tools")
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, topo: Topology, seed: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=topo.model, messages=kwargs.pop(
        "messages", MESSAGES), max_tokens=MAX_TOKENS, seed=seed, tools=TOOLS, **kwargs)


def assert_valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_choice_gives_one_schema_valid_call(client: openai.OpenAI, topo: Topology) -> None:
    for seed in range(3):
        choice = ask(client, topo, seed, tool_choice=NAMED).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function"
        assert calls[0].id.startswith("call_")
        assert calls[0].function.name == "get_weather"
        assert_valid([(c.function.name, c.function.arguments) for c in calls])


def test_a_named_call_with_a_short_string_finishes_within_64_tokens(client: openai.OpenAI,
                                                                   topo: Topology) -> None:
    # Arguments come as compact JSON (--json-whitespace 0), so a random model cannot spend its
    # tokens on whitespace between keys; sampled at temperature 1, as a new user would ask.
    for seed in range(5):
        reply = client.chat.completions.create(
            model=topo.model, messages=MESSAGES, max_tokens=64, seed=seed, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert reply.usage is not None and reply.usage.completion_tokens <= 64
        assert_valid([(c.function.name, c.function.arguments)
                      for c in choice.message.tool_calls or []])


def test_required_choice_gives_valid_calls(client: openai.OpenAI, topo: Topology) -> None:
    finished = 0
    for seed in range(3):
        choice = ask(client, topo, seed, tool_choice="required",
                     parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(calls) == 1
        assert_valid(calls)
        choice = ask(client, topo, seed, tool_choice="required").choices[0]
        if choice.finish_reason == "tool_calls":  # an array of calls may run to max_tokens
            finished += 1
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            assert calls
            assert_valid(calls)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("[")
    assert finished


def test_streamed_calls_assemble_to_the_same_calls(client: openai.OpenAI, topo: Topology) -> None:
    for kwargs in ({"tool_choice": NAMED}, {"tool_choice": "required",
                                            "parallel_tool_calls": False}):
        whole = ask(client, topo, 5, temperature=0, **kwargs).choices[0]
        stream = ask(client, topo, 5, temperature=0, stream=True, **kwargs)
        calls: dict[int, dict[str, str]] = {}
        content, finish = "", None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:  # a call's first delta: id, type, name
                    assert call.id and call.type == "function" and call.function
                    assert call.function.name and call.function.arguments == ""
                    calls[call.index] = {"name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function and call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_call_and_its_result_round_trip(client: openai.OpenAI, topo: Topology) -> None:
    reply = ask(client, topo, 1, tool_choice=NAMED)
    message = reply.choices[0].message
    call = (message.tool_calls or [])[0]
    conversation = [*MESSAGES, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = ask(client, topo, 1, messages=conversation)  # tool_choice auto: parsed by hermes
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) or choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or "")
    assert answer.usage is not None and answer.usage.prompt_tokens > reply.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in ask(
        client, topo, 1, messages=conversation, stream=True) if c.choices)
    assert "<tool_call>" not in text


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"extra_body": {"logit_bias": {"5": 10}}}, "logit_bias"),
    ({"extra_body": {"audio": {"voice": "alloy", "format": "wav"}}}, "audio"),
    ({"extra_body": {"modalities": ["text", "audio"]}}, "modalities"),
    ({"extra_body": {"prediction": {"type": "content", "content": "x"}}}, "prediction"),
    ({"extra_body": {"web_search_options": {"search_context_size": "low"}}},
     "web_search_options"),
    ({"extra_body": {"store": True}}, "store"),
    ({"extra_body": {"service_tier": "flex"}}, "service_tier"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"extra_body": {"function_call": "auto"}}, "function_call"),
    ({"n": 17}, "n"),
    ({"extra_body": {"reasoning_effort": "low"}}, "reasoning_effort"),  # template never reads it
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize(("kwargs", "param"), REFUSED)
def test_refused_fields_are_400s_naming_them(client: openai.OpenAI, topo: Topology,
                                             kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, topo, 0, **kwargs)
    assert info.value.status_code == 400
    assert info.value.param == param  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as info:  # tools do not apply to completions
        client.completions.create(model=topo.model, prompt="x", max_tokens=4,
                                  extra_body={"tools": TOOLS})
    assert info.value.param == "tools"  # type: ignore[attr-defined]
    # and the service is still up
    reply = ask(client, topo, 0, tool_choice="none", max_completion_tokens=4)
    assert reply.choices[0].message.tool_calls is None


def test_grpc_named_choice_streams_tool_call_deltas(topo: Topology) -> None:
    request = inference_pb2.InferenceRequest(
        model=topo.model, chat=inference_pb2.ChatInput(messages=[
            inference_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])]),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, seed=3),
        tools=[inference_pb2.Tool(name=t["function"]["name"],
                                  parameters=json.dumps(t["function"]["parameters"]))
               for t in TOOLS],
        tool_choice=inference_pb2.ToolChoice(function_name="get_time"))
    with grpc.insecure_channel(topo.grpc_address) as channel:
        chunks = list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_time" and deltas[0].id.startswith("call_")
    arguments = "".join(d.arguments for d in deltas)
    jsonschema.validate(json.loads(arguments), TIME_PARAMS)
    assert "".join(c.text for c in chunks) == ""
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
