"""Speculative decoding served by `tandem up` on the reference engine, aggregated and
disaggregated (real NIXL), by prompt lookup, by a draft model (the target itself, so that
its guesses are right) and by an EAGLE-3 head (random: the decode worker, which never saw the
prompt's hidden states, starts it from the positions it computes): greedy tokens equal transformers', the draft's proposals are accepted
(OpenAI's usage.completion_tokens_details; a random model's answers give prompt lookup little
to find, and a round that finds nothing backs off), and a request that opts out is not
speculated."""
from __future__ import annotations

import json
import pathlib
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.test_disagg_reference import model_dir, reference  # noqa: F401 (fixtures)
from tests.e2e.test_reference_engine import Reference
from tests.e2e.topology import Topology, start_topology

MAX_TOKENS = 24
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3, "disable_by_batch_size": 0})
ENGINE_FLAGS = ("--engine", "reference", "--device", "cpu", "--kv-block-size", "16",
                "--num-gpu-blocks-override", "256")


@pytest.fixture(scope="module", params=[("aggregated", "ngram"), ("disaggregated", "ngram"),
                                        ("disaggregated", "draft_model"),
                                        ("disaggregated", "eagle3")])
def served(request: pytest.FixtureRequest, model_dir: pathlib.Path,  # noqa: F811 (fixture)
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Topology, str]]:
    mode, method = request.param
    draft = model_dir
    if method == "eagle3":  # a random head: its guesses are hints the decode worker verifies
        from tandem.model.tiny_eagle3 import write_tiny_eagle3

        draft = write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), model_dir, seed=1)
    spec = SPEC if method == "ngram" else json.dumps({
        "method": method, "num_speculative_tokens": 3, "model": str(draft),
        "disable_by_batch_size": 0})
    topo = start_topology(*ENGINE_FLAGS, "--model", str(model_dir), "--speculative-config", spec,
                          num_prefill=1 if mode == "disaggregated" else 0)
    yield topo, method
    assert topo.stop() == 0


def copy_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat a phrase: prompt lookup proposes its continuation."""
    rng = random.Random(11)
    out = []
    for n in (3, 4, 6, 8, 5, 7):
        phrase = [rng.randrange(4, vocab) for _ in range(n)]
        out.append(phrase * 4 + phrase[:2])
    return out


def test_greedy_equals_transformers_and_proposals_are_accepted(
        served: tuple[Topology, str], reference: Reference) -> None:  # noqa: F811 (fixture)
    topo, method = served
    client = openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)
    batch = copy_prompts(reference.tokenizer.vocab_size)

    def complete(ids: list[int], speculative: bool = True) -> openai.types.Completion:
        return client.completions.create(
            model=topo.model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "speculative_decoding": speculative})

    with ThreadPoolExecutor(len(batch)) as pool:
        got = list(pool.map(complete, batch))
    accepted = proposed = 0
    for ids, completion in zip(batch, got, strict=True):
        want, _ = reference.greedy(ids, MAX_TOKENS)
        assert completion.choices[0].text == reference.text(want)
        details = completion.usage.completion_tokens_details
        assert details is not None and completion.usage.completion_tokens == MAX_TOKENS
        accepted += details.accepted_prediction_tokens
        proposed += details.accepted_prediction_tokens + details.rejected_prediction_tokens
    if method == "draft_model":  # the target as its own draft: its guesses are right
        assert accepted > 0, "no proposal was accepted"
    if method == "eagle3":  # from the positions the decode worker computed
        assert proposed > 0, "nothing was proposed"
    # Opted out: the same text, nothing proposed.
    off = complete(batch[0], speculative=False)
    assert off.choices[0].text == got[0].choices[0].text
    details = off.usage.completion_tokens_details
    assert details is not None
    assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
