"""Several models behind one frontend: `tandem up --config` with a deployment file listing two
text models (the demo model, and a tiny random-weights Llama with Qwen's chat template), each
with its own pool and router. /v1/models and the gRPC ListModels list both; each request goes
to its model's pool and is tokenized with that model's template; an unknown model is a 404
naming it; the metrics carry each model's label."""
from __future__ import annotations

import json
import pathlib
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
import yaml
from transformers import AutoTokenizer

from tandem.v1 import inference_pb2, inference_pb2_grpc
from tests.chat_templates import QWEN_TOOLS, use_template
from tests.e2e.topology import Topology, consecutive_free_ports, free_ports, start_topology

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen-template", "llama",
                             seed=0, max_position_embeddings=2048)
    use_template(model, QWEN_TOOLS)
    return model


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, tiny_dir: pathlib.Path) -> Iterator[Topology]:
    demo_port, tiny_port = free_ports(2)
    router = consecutive_free_ports(2)[0]  # one router per model, on consecutive ports
    deployment = {"models": [
        {"name": "demo", "pools": [{"name": "decode", "kind": "decode", "ports": [demo_port]}]},
        {"name": "tiny", "model": str(tiny_dir), "pools": [
            {"name": "decode", "kind": "decode", "ports": [tiny_port], "policy": "kv"}]}]}
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


def test_both_models_are_listed(client: openai.OpenAI, topo: Topology) -> None:
    assert [m.id for m in client.models.list().data] == ["demo", "tiny"]
    with grpc.insecure_channel(topo.grpc_address) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), timeout=10)
    assert [m.id for m in reply.models] == ["demo", "tiny"]


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


def test_streams_of_both_models_run_together(client: openai.OpenAI) -> None:
    streams = [client.completions.create(model=name, prompt="Once upon a time", max_tokens=8,
                                         stream=True, extra_body={"ignore_eos": True})
               for name in ("demo", "tiny", "demo")]
    for stream in streams:
        chunks = list(stream)
        assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
        assert {c.model for c in chunks} <= {"demo", "tiny"}


def test_metrics_carry_each_models_label(topo: Topology) -> None:
    text = urllib.request.urlopen(topo.http_url + "/metrics", timeout=10).read().decode()
    for name in ("demo", "tiny"):
        assert re.search(rf'^tandem_frontend_requests_total{{[^}}]*model="{name}"', text,
                         re.MULTILINE), name
