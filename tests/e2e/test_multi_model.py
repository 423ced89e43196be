"""Several models behind one frontend: `tandem up --config` with a deployment file listing two
text models (the demo model, and a tiny random-weights Llama with Qwen's chat template) and an
embedding model (a tiny Llama saved by sentence-transformers, mean pooling, normalised), each
with its own pool and router. /v1/models and the gRPC ListModels list all three; each request
goes to its model's pool and is tokenized with that model's template; embeddings (the official
client's base64 and floats) equal sentence-transformers'; a request to the wrong kind of model
is a 400, an unknown model a 404 naming it; the metrics carry each model's label."""
from __future__ import annotations

import json
import pathlib
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import openai
import pytest
import yaml
from transformers import AutoTokenizer

from tandem.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.tiny_tools import write_tools_model
from tests.e2e.topology import Topology, consecutive_free_ports, free_ports, start_topology

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tools_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen-template")


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny Llama as sentence-transformers saves it (the base model), its texts tokenized
    as plain text: sentence-transformers >= 6 saves a "message" modality too, which would
    render them through the chat template, which this model has and the frontend does not
    apply to embedding inputs."""
    from sentence_transformers import SentenceTransformer, models

    from tandem.model.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("embed")
    base = write_tiny_model(root / "base", "llama", seed=3)
    out = root / "tiny-embed"
    SentenceTransformer(modules=[models.Transformer(str(base)), models.Pooling(64, "mean"),
                                 models.Normalize()], device="cpu").save(str(out))
    config_file = out / "sentence_bert_config.json"
    config = json.loads(config_file.read_text())
    config.get("modality_config", {}).pop("message", None)
    config_file.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, tiny_dir: pathlib.Path,
         embed_dir: pathlib.Path) -> Iterator[Topology]:
    demo_port, tiny_port, embed_port = free_ports(3)
    router = consecutive_free_ports(3)[0]  # one router per model, on consecutive ports
    deployment = {"models": [
        {"name": "demo", "pools": [{"name": "decode", "kind": "decode", "ports": [demo_port]}]},
        {"name": "tiny", "model": str(tiny_dir), "tool_call_parser": "hermes", "pools": [
            {"name": "decode", "kind": "decode", "ports": [tiny_port], "policy": "kv"}]},
        {"name": "embed", "model": str(embed_dir), "pools": [
            {"name": "embed", "kind": "embedding", "ports": [embed_port],
             "policy": "least_loaded"}]}]}
    path = tmp_path_factory.mktemp("deploy") / "deployment.yaml"
    path.write_text(yaml.safe_dump(deployment))
    topo = start_topology("--config", str(path), "--router-port", str(router), "--engine",
                          "reference", "--device", "cpu", "--kv-block-size", "32",
                          "--num-gpu-blocks-override", "128")
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


def post(topo: Topology, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(topo.http_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_every_model_is_listed(client: openai.OpenAI, topo: Topology) -> None:
    assert [m.id for m in client.models.list().data] == ["demo", "tiny", "embed"]
    with grpc.insecure_channel(topo.grpc_address) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), timeout=10)
    assert [m.id for m in reply.models] == ["demo", "tiny", "embed"]


def test_each_request_goes_to_its_models_pool_with_its_template(
        topo: Topology, tiny_dir: pathlib.Path) -> None:
    for name, model_dir in (("demo", topo.tokenizer_dir), ("tiny", str(tiny_dir))):
        status, headers, body = post(topo, "/v1/chat/completions", {
            "model": name, "messages": MESSAGES, "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        assert body["model"] == name
        assert headers["x-tandem-pool"] == f"{name}-decode"
        expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert body["usage"]["prompt_tokens"] == len(expected)


def test_an_unknown_model_is_a_404_naming_it_and_the_served_ones(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gamma", messages=MESSAGES,  # type: ignore[arg-type]
                                       max_tokens=2)
    text = str(info.value)
    assert "'gamma'" in text and "'demo'" in text and "'tiny'" in text
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gamma", input="x")


def test_embeddings_equal_sentence_transformers(client: openai.OpenAI,
                                                embed_dir: pathlib.Path) -> None:
    from sentence_transformers import SentenceTransformer

    texts = ["The quick brown fox", "jumps over the lazy dog", "a"]
    want = SentenceTransformer(str(embed_dir), device="cpu").encode(texts)
    tokenizer = AutoTokenizer.from_pretrained(str(embed_dir))
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    packed = client.embeddings.create(model="embed", input=texts)  # base64 on the wire
    floats = client.embeddings.create(model="embed", input=texts, encoding_format="float")
    for reply in (packed, floats):
        assert [d.index for d in reply.data] == [0, 1, 2]
        got = np.array([d.embedding for d in reply.data])
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert reply.usage.prompt_tokens == num_tokens
    token_ids = tokenizer(texts[0])["input_ids"]
    by_ids = client.embeddings.create(model="embed", input=[token_ids],
                                      encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-6)


def test_the_wrong_kind_of_model_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model="embed", messages=MESSAGES,  # type: ignore[arg-type]
                                       max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no embedding workers"):
        client.embeddings.create(model="demo", input="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="embed", input="x", dimensions=8)
    assert info.value.param == "dimensions"  # type: ignore[attr-defined]


def test_streams_of_both_models_run_together(client: openai.OpenAI) -> None:
    streams = [client.completions.create(model=name, prompt="Once upon a time", max_tokens=8,
                                         stream=True, extra_body={"ignore_eos": True})
               for name in ("demo", "tiny", "demo")]
    for stream in streams:
        chunks = list(stream)
        assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
        assert {c.model for c in chunks} <= {"demo", "tiny"}


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
           "required": ["city"]}


def test_responses_with_a_tool_round_trip_on_each_text_model(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    for name in ("demo", "tiny"):
        plain = client.responses.create(model=name, input="Hi", max_output_tokens=4,
                                        temperature=0)
        assert plain.model == name and plain.output
    first = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[tool],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=48, temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    assert json.loads(call.arguments)["city"] in ("Oslo", "Lima")
    follow = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=[tool], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5 C"}],
        max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == first.id and follow.model == "tiny"


def test_anthropic_messages_with_a_tool_round_trip(topo: Topology) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=topo.http_url, api_key="unused", max_retries=0)
    for name in ("demo", "tiny"):
        reply = client.messages.create(model=name, max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}])
        assert reply.model == name and reply.content
    tools: Any = [{"name": "get_weather", "input_schema": WEATHER}]
    first = client.messages.create(model="tiny", max_tokens=48, tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": "Weather in Oslo?"}])
    use = next(block for block in first.content if block.type == "tool_use")
    assert first.stop_reason == "tool_use" and use.input["city"] in ("Oslo", "Lima")
    follow = client.messages.create(model="tiny", max_tokens=4, tools=tools, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "5 C"}]}],
        tool_choice={"type": "none"})
    assert follow.model == "tiny"


def test_metrics_carry_each_models_label(topo: Topology) -> None:
    text = urllib.request.urlopen(topo.http_url + "/metrics", timeout=10).read().decode()
    for name in ("demo", "tiny", "embed"):
        assert re.search(rf'^tandem_frontend_requests_total{{[^}}]*model="{name}"', text,
                         re.MULTILINE), name
