"""`--reasoning-parser deepseek_r1` end to end, on a tiny random-weights Llama. Random weights
never write `</think>`, and for DeepSeek-R1 text before `</think>` is reasoning whether or not
`<think>` opened it: so the whole answer must come back as `reasoning_content` (streamed and
not) and `content` must be empty, equal token for token to what the model generates for the
same prompt through /v1/completions, where no parser runs. Under a constraint (response_format)
nothing is reasoning."""
from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tandem.frontend.tokenizer import Tokenizer
from tests.e2e.topology import Topology, start_topology

MESSAGES: list[Any] = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY: dict[str, Any] = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    from tandem.model.tiny import write_tiny_model

    model: pathlib.Path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-r1",
                                           "llama", seed=1)
    topo = start_topology("--engine", "reference", "--model", str(model), "--device", "cpu",
                          "--kv-block-size", "32", "--num-gpu-blocks-override", "128",
                          "--reasoning-parser", "deepseek_r1")
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


def test_an_answer_without_think_tags_is_all_reasoning(client: openai.OpenAI,
                                                       topo: Topology) -> None:
    tokenizer = Tokenizer.from_dir(topo.tokenizer_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES)
    raw = client.completions.create(model=topo.model, prompt=prompt, **GREEDY)
    text = raw.choices[0].text
    assert text.strip() and "</think>" not in text

    reply = client.chat.completions.create(model=topo.model, messages=MESSAGES, **GREEDY)
    message = reply.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == text.strip()
    assert not message.content and not message.tool_calls
    assert reply.choices[0].finish_reason == "length"

    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=topo.model, messages=MESSAGES,
                                                stream=True, **GREEDY):
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (text.strip(), "")


def test_a_constrained_answer_has_no_reasoning(client: openai.OpenAI, topo: Topology) -> None:
    reply = client.chat.completions.create(model=topo.model, messages=MESSAGES, max_tokens=40,
                                           extra_body={"guided_regex": "[a-z]{3,12}"})
    message = reply.choices[0].message
    assert message.content and message.content.isalpha()
    assert "reasoning_content" not in (message.model_extra or {})
