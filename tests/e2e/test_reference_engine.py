"""The official `openai` client against `tandem up --engine reference` serving a tiny Llama, with
greedy answers checked token for token against transformers' `generate` on the same files."""
from __future__ import annotations

import math
import pathlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.topology import Topology, start_topology

BLOCK_SIZE = 32
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
LONG_PROMPT = ("Tandem serves language models as separate stages that scale on their own. "
               "The router picks a worker that already holds the prompt's prefix. ") * 4
#: Logprobs of the engine and transformers agree this closely (float32, different kernels).
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tandem.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="module")
def topo(model_dir: pathlib.Path) -> Iterator[Topology]:
    topo = start_topology("--engine", "reference", "--model", str(model_dir), "--device", "cpu",
                          "--kv-block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", "256")
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="module")
def client(topo: Topology) -> openai.OpenAI:
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


class Reference:
    """transformers on the very files the engine serves."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Generated ids (EOS included when it came) and each one's logprob."""
        import torch

        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, output_logits=True,
                                      return_dict_in_generate=True)
        new = out.sequences[0, len(prompt_ids):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[token].item()
                    for step, token in zip(out.logits, new)]
        return new, logprobs

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def reference(model_dir: pathlib.Path) -> Reference:
    return Reference(model_dir)


def assert_same_tokens(got_texts: list[str], got_logprobs: list[float], want_ids: list[int],
                       want_logprobs: list[float], reference: Reference) -> None:
    assert got_texts == reference.token_texts(want_ids)
    worst = max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs))
    assert worst < LOGPROB_TOLERANCE, f"logprobs differ by up to {worst}"


def test_greedy_completion_equals_transformers(client: openai.OpenAI, topo: Topology,
                                               reference: Reference) -> None:
    prompt_ids = reference.tokenizer(PROMPT)["input_ids"]  # BOS + text, as the frontend encodes
    want_ids, want_logprobs = reference.greedy(prompt_ids, 24)
    assert len(set(want_ids)) > 4, "the test model must not just repeat one token"
    for prompt in (PROMPT, prompt_ids):  # text, and the same tokens given as ids
        reply = client.completions.create(model=topo.model, prompt=prompt, max_tokens=24,
                                          temperature=0, logprobs=0)
        choice = reply.choices[0]
        assert choice.text == reference.text(want_ids)
        assert_same_tokens(choice.logprobs.tokens, choice.logprobs.token_logprobs, want_ids,
                           want_logprobs, reference)
        assert reply.usage.prompt_tokens == len(prompt_ids)
        assert reply.usage.completion_tokens == len(want_ids)
        assert choice.finish_reason == ("length" if len(want_ids) == 24 else "stop")


def test_greedy_streamed_completion_equals_transformers(client: openai.OpenAI, topo: Topology,
                                                        reference: Reference) -> None:
    prompt = "Once upon a time"
    want_ids, _ = reference.greedy(reference.tokenizer(prompt)["input_ids"], 40)
    chunks = list(client.completions.create(model=topo.model, prompt=prompt, max_tokens=40,
                                            temperature=0, logprobs=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert text == reference.text(want_ids)
    assert tokens == reference.token_texts(want_ids)
    assert chunks[-1].usage.completion_tokens == len(want_ids)


def test_greedy_chat_equals_transformers(client: openai.OpenAI, topo: Topology,
                                         reference: Reference) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    prompt_ids = reference.chat_ids(messages)
    want_ids, want_logprobs = reference.greedy(prompt_ids, 30)
    reply = client.chat.completions.create(model=topo.model, messages=messages, max_tokens=30,
                                           temperature=0, logprobs=True)
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == reference.text(want_ids)
    assert_same_tokens([e.token for e in content], [e.logprob for e in content], want_ids,
                       want_logprobs, reference)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(want_ids)

    stream = client.chat.completions.create(model=topo.model, messages=messages, max_tokens=30,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reference.text(want_ids)
    assert chunks[-1].usage.completion_tokens == len(want_ids)


def test_repeated_long_prompt_hits_the_prefix_cache(client: openai.OpenAI,
                                                    topo: Topology) -> None:
    def ask() -> Any:
        return client.chat.completions.create(
            model=topo.model, messages=[{"role": "user", "content": LONG_PROMPT}],
            max_tokens=8, temperature=0)

    first, second = ask(), ask()
    prompt_tokens = second.usage.prompt_tokens
    assert prompt_tokens > 3 * BLOCK_SIZE
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every full block of the prompt but the one holding its last token comes from the cache.
    assert (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE <= cached < prompt_tokens
    # ... and the cached KV gives the very same answer.
    assert second.choices[0].message.content == first.choices[0].message.content


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, topo: Topology) -> None:
    def sample(seed: int | None, temperature: float = 1.0) -> str:
        seeded = {} if seed is None else {"seed": seed}
        reply = client.completions.create(model=topo.model, prompt=PROMPT, max_tokens=32,
                                          temperature=temperature, **seeded)
        assert reply.usage.completion_tokens == 32 or reply.choices[0].finish_reason == "stop"
        return reply.choices[0].text

    first = sample(7)
    assert sample(7) == first
    # The seed and the temperature are really used: another seed, or greedy, answers otherwise.
    assert sample(8) != first
    assert sample(None, temperature=0.0) != first


def test_logprobs_are_normalized(client: openai.OpenAI, topo: Topology) -> None:
    reply = client.chat.completions.create(
        model=topo.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=5)
    for entry in reply.choices[0].logprobs.content:
        probs = [math.exp(t.logprob) for t in entry.top_logprobs]
        assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-4
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top
