"""OpenAI's `n` through `tandem up` (mock engine, two decode workers, kv router): n choices
from one prompt, each its own seed stream, streamed with their indexes, usage summed, the
prompt's blocks computed once and reused by the other choices."""
from __future__ import annotations

import uuid
from collections import defaultdict

import grpc
import openai
import pytest

from tandem.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.topology import Topology

#: tandem up's default --kv-block-size.
BLOCK_TOKENS = 32


@pytest.fixture(scope="module")
def client(topology: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topology.http_url + "/v1", api_key="unused", max_retries=0)


def _texts(reply: openai.types.chat.ChatCompletion) -> list[str | None]:
    return [c.message.content for c in reply.choices]


def test_chat_n_choices_each_with_its_seed(client: openai.OpenAI, topology: Topology) -> None:
    args = dict(model=topology.model, messages=[{"role": "user", "content": "Three answers."}],
                max_tokens=12, temperature=1.0, seed=1234, n=3)
    reply = client.chat.completions.create(**args)  # type: ignore[call-overload]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert len(set(_texts(reply))) == 3  # seeds 1234, 1235, 1236: three answers
    assert reply.usage.completion_tokens == 3 * 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 36
    # The same seed gives the same choices; choice i is what n=1 with seed + i gives.
    assert _texts(client.chat.completions.create(**args)) == _texts(reply)  # type: ignore
    single = client.chat.completions.create(**{**args, "n": 1, "seed": 1236})  # type: ignore
    assert single.choices[0].message.content == reply.choices[2].message.content


def test_n_without_a_seed_still_gives_distinct_choices(client: openai.OpenAI,
                                                       topology: Topology) -> None:
    # The mock engine is deterministic per prompt: only per-choice seeds tell the choices apart.
    reply = client.completions.create(model=topology.model, prompt="Pick a word:", max_tokens=10,
                                      n=4)
    assert len({c.text for c in reply.choices}) == 4


def test_streamed_choices_equal_the_non_streamed_ones(client: openai.OpenAI,
                                                      topology: Topology) -> None:
    args = dict(model=topology.model, prompt="Stream two of them.", max_tokens=20, seed=99, n=2,
                logprobs=1)
    whole = client.completions.create(**args)  # type: ignore[call-overload]
    stream = client.completions.create(**args, stream=True,  # type: ignore[call-overload]
                                       stream_options={"include_usage": True})
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, int] = defaultdict(int)
    finishes: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, as OpenAI streams them
        texts[choice.index] += choice.text
        tokens[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in (0, 1)] == [c.text for c in whole.choices]
    assert tokens == {0: 20, 1: 20} and finishes == {0: "length", 1: "length"}
    usage = chunks[-1].usage  # once, after both choices finished, counting both
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 40 == whole.usage.completion_tokens


def test_chat_stream_sends_a_role_chunk_per_choice(client: openai.OpenAI,
                                                    topology: Topology) -> None:
    chunks = list(client.chat.completions.create(
        model=topology.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=3,
        stream=True))
    roles = sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant")
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert roles == finished == [0, 1, 2]


def test_other_choices_reuse_the_prompt_blocks(topology: Topology) -> None:
    # A prompt no earlier test sent: 4 full blocks. Choice 0 computes them; the other choices,
    # sent once it has its first token, find them in the prefix cache (usage per choice through
    # the gRPC API).
    prompt = f"{uuid.uuid4().hex} " + "the prefix is computed once for every choice " * 40
    with grpc.insecure_channel(topology.grpc_address) as channel:
        chunks = list(inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.InferenceRequest(
                model=topology.model, prompt=prompt, n=4,
                sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True)), timeout=60))
    usage = {c.index: c.usage for c in chunks if c.HasField("usage")}
    assert sorted(usage) == [0, 1, 2, 3]
    assert all(u.completion_tokens == 6 for u in usage.values())
    full_blocks = usage[0].prompt_tokens // BLOCK_TOKENS
    assert full_blocks >= 4 and usage[0].cached_tokens == 0
    assert all(usage[i].cached_tokens == full_blocks * BLOCK_TOKENS for i in (1, 2, 3))
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        texts[chunk.index] += chunk.text
    assert len(set(texts.values())) == 4


def test_n_beyond_the_limit_is_a_400(client: openai.OpenAI, topology: Topology) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=topology.model, prompt="x", max_tokens=2, n=17)
    assert info.value.param == "n"  # type: ignore[attr-defined]
    assert client.completions.create(model=topology.model, prompt="x", max_tokens=2).choices


def test_best_of_returns_the_likeliest_of_the_generated_choices(client: openai.OpenAI,
                                                                topology: Topology) -> None:
    args = dict(model=topology.model, prompt="Best of three:", max_tokens=8, seed=42, logprobs=0)
    every = client.completions.create(**args, n=3)  # type: ignore[call-overload]
    best = client.completions.create(**args, n=2, best_of=3)  # type: ignore[call-overload]

    def mean(choice: object) -> float:
        values = choice.logprobs.token_logprobs  # type: ignore[attr-defined]
        return sum(values) / len(values)

    # Same seeds (42, 43, 44): the same three choices, of which the two likeliest come back.
    ranked = sorted(every.choices, key=mean, reverse=True)[:2]
    assert [c.text for c in best.choices] == [c.text for c in ranked]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 3 * 8  # all three were generated
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args, best_of=2, stream=True)  # type: ignore[call-overload]
    assert info.value.param == "best_of"  # type: ignore[attr-defined]
