"""The official `openai` client against a topology started by `tandem up`."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.topology import Topology

LONG_PROMPT = ("Tandem serves language models as separate stages that scale on their own. "
               "The router picks a worker that already holds the prompt's prefix. ") * 4


@pytest.fixture(scope="module")
def client(topology: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topology.http_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI, topology: Topology) -> None:
    assert [m.id for m in client.models.list().data] == [topology.model]


def test_chat_non_streaming_usage_matches_tokens(client: openai.OpenAI, topology: Topology) -> None:
    reply = client.chat.completions.create(
        model=topology.model, messages=[{"role": "user", "content": "Say something."}],
        max_tokens=17, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content
    # One logprob entry per generated token: usage must count exactly those.
    assert len(choice.logprobs.content) == reply.usage.completion_tokens == 17
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 17
    # The mock engine does not speculate: the drafts' counts are there, and 0.
    details = reply.usage.completion_tokens_details
    assert details is not None
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


def test_chat_streaming_with_usage(client: openai.OpenAI, topology: Topology) -> None:
    stream = client.chat.completions.create(
        model=topology.model, messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=40, stream=True, stream_options={"include_usage": True}, logprobs=True,
        extra_body={"speculative_decoding": False})
    chunks = list(stream)
    tokens = sum(len(c.choices[0].logprobs.content) for c in chunks
                 if c.choices and c.choices[0].logprobs)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finish == ["length"]
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == tokens == 40
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.rejected_prediction_tokens == 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


@pytest.mark.parametrize("where", ["top", "nvext"])
def test_a_non_boolean_speculative_decoding_is_a_400(client: openai.OpenAI, topology: Topology,
                                                      where: str) -> None:
    body = {"speculative_decoding": "no"}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=topology.model, prompt="hi", max_tokens=2,
                                  extra_body=body if where == "top" else {"nvext": body})
    param = "speculative_decoding" if where == "top" else "nvext.speculative_decoding"
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


def test_streamed_text_equals_non_streamed_text(client: openai.OpenAI, topology: Topology) -> None:
    # The mock engine is deterministic per prompt, so both must detokenize to the same text.
    args = dict(model=topology.model, prompt="Once upon a time", max_tokens=60, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True)
                       if c.choices)
    assert streamed == whole and whole


def test_completions_usage_and_stop_string(client: openai.OpenAI, topology: Topology) -> None:
    base = client.completions.create(model=topology.model, prompt="Count with me:",
                                      max_tokens=30, temperature=0)
    text = base.choices[0].text
    assert base.usage.completion_tokens == 30
    # Stop on a string from the middle of that deterministic answer: the text ends right before.
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = client.completions.create(model=topology.model, prompt="Count with me:",
                                     max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage.completion_tokens < 30


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI, topology: Topology) -> None:
    messages = [{"role": "user", "content": LONG_PROMPT}]
    # Two decode workers behind round robin: send enough copies that each worker sees it twice.
    usages = [client.chat.completions.create(model=topology.model, messages=messages,
                                             max_tokens=4).usage for _ in range(4)]
    assert usages[0].prompt_tokens > 64
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert max(u.prompt_tokens_details.cached_tokens for u in usages[2:]) >= 32


def test_stop_string_answer_still_reports_cached_tokens(slow_topology: Topology) -> None:
    # Real-time steps: tokens arrive a few per chunk, so an early stop string ends the answer
    # mid-stream, before the worker's final usage arrives.
    client = openai.OpenAI(base_url=slow_topology.http_url + "/v1", api_key="x", max_retries=0)
    prompt = "Cached prefix for a stop-string answer. " * 12
    args = dict(model=slow_topology.model, prompt=prompt, max_tokens=60, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    stop = whole[len(whole) // 5:len(whole) // 5 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 30
    assert cut.usage.prompt_tokens_details.cached_tokens >= 32
