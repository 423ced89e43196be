"""Mixture-of-experts models served by `tandem up` (real processes, real NIXL): Mixtral with a
sliding window shorter than the prompts, and Qwen3-MoE with a dense layer among its sparse ones.
Disaggregated (prefill worker -> KV over NIXL -> decode worker) and aggregated answers both equal
transformers' greedy tokens, prefix-cache hits included."""
from __future__ import annotations

import pathlib
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.disagg_probe import generate, wait_idle
from tests.e2e.test_reference_engine import Reference
from tests.e2e.topology import Topology, start_topology

BLOCK_SIZE = 16
MAX_TOKENS = 8
#: Mixtral's window: shorter than the longer prompts, so the sliding-window mask decides tokens.
WINDOW = 24
MODELS = {"mixtral": {"sliding_window": WINDOW}, "qwen3_moe": {}}


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Topology, Reference]]:
    from tandem.model.tiny import write_tiny_model

    family = request.param
    model_dir = write_tiny_model(tmp_path_factory.mktemp("moe") / family, family, seed=5,
                                 **MODELS[family])
    topo = start_topology("--engine", "reference", "--device", "cpu", "--model",
                          str(model_dir), "--kv-block-size", str(BLOCK_SIZE),
                          "--num-gpu-blocks-override", "256", num_prefill=1)
    try:
        yield topo, Reference(pathlib.Path(model_dir))
    finally:
        assert topo.stop() == 0


def test_moe_answers_equal_transformers_disaggregated_and_aggregated(
        served: tuple[Topology, Reference]) -> None:
    topo, reference = served
    (decode,), (pre,) = topo.decode_addresses, topo.prefill_addresses
    rng = random.Random(11)
    vocab = reference.tokenizer.vocab_size
    shared = [rng.randrange(4, vocab) for _ in range(40)]
    batch = [[rng.randrange(4, vocab) for _ in range(n)] for n in (3, 17, 30, 70)]
    client = openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)

    def complete(ids: list[int]) -> openai.types.Completion:
        return client.completions.create(model=topo.model, prompt=ids, max_tokens=MAX_TOKENS,
                                         temperature=0)

    first = complete(shared + [5])  # the shared prefix enters the caches
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(complete, [*batch, shared + [6, 7], shared + [8]]))
    for ids, answer in zip([shared + [5], *batch, shared + [6, 7], shared + [8]],
                           [first, *answers], strict=True):
        expected, _ = reference.greedy(ids, MAX_TOKENS)
        assert answer.choices[0].text == reference.text(expected), len(ids)
        # The same prompt aggregated, on the decode worker alone.
        aggregated, _ = generate(decode, f"agg-{len(ids)}-{ids[0]}", ids, MAX_TOKENS)
        assert aggregated == expected, len(ids)
    # Two full blocks of the shared prefix were served from a cache.
    assert all(a.usage.prompt_tokens_details.cached_tokens >= 32 for a in answers[-2:])
    wait_idle(decode, pre)
