"""The Responses API end to end: the official `openai` client against `tandem up --engine
reference --tool-call-parser hermes` on a tiny random-weights Llama with Qwen2.5's chat template.
The weights make gibberish, so these tests check structure: the response object, the streamed
events in their documented order with sequence numbers 0, 1, 2, ..., a forced function call and
its result sent back with previous_response_id, a json_schema output that parses, the store
(retrieve, delete) and errors that name the Responses field."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import requests

from tests.e2e.tiny_tools import start_tools_topology
from tests.e2e.topology import Topology

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather",
                     "parameters": CITY, "strict": True}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    topo = start_tools_topology(tmp_path_factory.mktemp("tiny") / "tiny-responses")
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


def create(client: openai.OpenAI, topo: Topology, **kwargs: Any) -> Any:
    kwargs.setdefault("input", "Say hello.")
    return client.responses.create(model=topo.model, temperature=0,
                                   max_output_tokens=kwargs.pop("max_output_tokens", 12),
                                   **kwargs)


def test_non_streamed_response(client: openai.OpenAI, topo: Topology) -> None:
    reply = create(client, topo, instructions="Be brief.", metadata={"run": "e2e"})
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.model == topo.model and reply.metadata == {"run": "e2e"}
    assert reply.status in ("completed", "incomplete")
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
    message = reply.output[-1]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert reply.output_text == message.content[0].text
    usage = reply.usage
    assert usage.output_tokens >= 1 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert reply.instructions == "Be brief." and reply.temperature == 0


def test_stream_follows_the_documented_order(client: openai.OpenAI, topo: Topology) -> None:
    events = list(create(client, topo, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and events[0].response.id == final.id
    assert client.responses.retrieve(final.id).output_text == text  # streamed ones are stored


def test_function_call_round_trip(client: openai.OpenAI, topo: Topology) -> None:
    first = create(client, topo, input="Weather in Paris?", tools=TOOLS,
                   tool_choice={"type": "function", "name": "get_weather"},
                   max_output_tokens=64)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    follow = create(client, topo, previous_response_id=first.id, tools=TOOLS,
                    tool_choice="none", input=[{"type": "function_call_output",
                                                "call_id": call.call_id, "output": "sunny"}])
    assert follow.previous_response_id == first.id
    assert follow.output[-1].type == "message"
    # The follow-up's prompt holds the first turn: more input tokens than the output alone.
    assert follow.usage.input_tokens > first.usage.input_tokens


def test_streamed_function_call(client: openai.OpenAI, topo: Topology) -> None:
    events = list(create(client, topo, input="Weather?", tools=TOOLS, tool_choice="required",
                         max_output_tokens=64, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), CITY)


def test_json_schema_output_parses(client: openai.OpenAI, topo: Topology) -> None:
    reply = create(client, topo, max_output_tokens=32, text={"format": {
        "type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), ANSWER)
    assert reply.text.format.type == "json_schema"


def test_retrieve_and_delete(client: openai.OpenAI, topo: Topology) -> None:
    reply = create(client, topo)
    assert client.responses.retrieve(reply.id).output_text == reply.output_text
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(reply.id)
    unstored = create(client, topo, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def error(topo: Topology, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    reply = requests.post(topo.http_url + "/v1/responses", json=body, timeout=30)
    return reply.status_code, reply.json()["error"]


@pytest.mark.parametrize(("fields", "status", "param"), [
    ({"model": "no-such-model"}, 404, "model"),
    ({"background": True}, 400, "background"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"previous_response_id": "resp_unknown"}, 400, "previous_response_id"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"not_a_field": 1}, 400, "not_a_field"),
])
def test_errors_name_the_responses_field(topo: Topology, fields: dict[str, Any], status: int,
                                         param: str) -> None:
    code, body = error(topo, {"model": topo.model, "input": "x", **fields})
    assert (code, body["param"]) == (status, param), body
    assert body["type"] in ("invalid_request_error", "not_found_error")
    assert requests.get(topo.http_url + "/health", timeout=10).status_code == 200
