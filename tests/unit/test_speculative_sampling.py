"""Sampling with speculation follows the target's distribution, tested statistically (issue 44,
item 3). A proposer guesses, after each first token a, the target's likeliest next token g(a)
(a one-hot proposal), so every request's second step verifies one proposal: the second token
is g(a) with the target's probability p(g(a) | a) (the proposal accepted) and otherwise the
target's draw with g(a) excluded (Leviathan et al.'s rejection sampling), and after an
accepted guess the third token comes from the verify pass's next row. Over many differently
seeded requests the joint distribution of the first two tokens, and the third's after an
accepted guess, are compared with the target's softmax at the temperature, computed by
transformers on the same checkpoint (float32), by chi-square tests. test_speculative_engine.py
checks the stronger per-seed equality with plain decoding; this one checks the distribution
itself, so that an acceptance rule that favoured proposals (or read the wrong row) fails even
if plain decoding shared the bug."""
from __future__ import annotations

import asyncio
import pathlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tandem.engines.batching.request import BatchRequest
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.proposer import Proposer
from tandem.engines.speculative.speculation import Speculation
from tandem.engines.types import SamplingParams
from tandem.model.tiny import write_tiny_model
from tests.unit.test_speculative_engine import engine_for, generate, tokens

stats = pytest.importorskip("scipy.stats")
transformers = pytest.importorskip("transformers")

TEMPERATURE = 0.5
SAMPLES = 3000
#: Each chi-square test's false-failure rate (two tests: about 2 in 10^4 runs); the seeds are
#: fixed, so a run repeats its verdict as long as the engine batches the requests alike.
ALPHA = 1e-4


class GuessAfter(Proposer):
    """Proposes guesses[last token], k times; nothing after a token without a guess."""

    def __init__(self, guesses: Sequence[int]) -> None:
        self.guesses = guesses

    def propose(self, reqs: Sequence[BatchRequest], ks: Sequence[int],
                blocks: Sequence[list[int]] | None = None) -> list[list[int]]:
        return [[self.guesses[req.token_ids[req.num_final - 1]]] * k
                for req, k in zip(reqs, ks, strict=True)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


def next_probs(model: pathlib.Path, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), V] float64: the target's next-token distributions at TEMPERATURE."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor(prompts)).logits[:, -1].double()
    return torch.softmax(logits / TEMPERATURE, dim=-1)


def chi_square_p(observed: Counter[Any], expected: dict[Any, float]) -> float:
    """p-value of `observed` draws against `expected` counts (summing to the same total), the
    outcomes expected fewer than 5 times pooled into one bin (the chi-square approximation
    needs 5 per bin)."""
    total = sum(observed.values())
    big = [key for key, e in expected.items() if e >= 5]
    obs = [observed.get(key, 0) for key in big]
    exp = [expected[key] for key in big]
    rest_obs, rest_exp = total - sum(obs), total - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:  # too little left for a bin: fold it into the largest
        obs[exp.index(max(exp))] += rest_obs
        exp[exp.index(max(exp))] += rest_exp
    assert len(obs) >= 5, "too few bins for the test to bite"
    return float(stats.chisquare(obs, exp).pvalue)


def test_sampled_tokens_follow_the_target_distribution(tiny: pathlib.Path) -> None:
    prompt = [7, 31, 99, 12, 54, 200, 3, 77]
    first = next_probs(tiny, [prompt])[0]
    vocab = first.numel()
    second = next_probs(tiny, [prompt + [a] for a in range(vocab)])  # [a, b]: p(b | a)
    guesses = second.argmax(dim=1).tolist()
    accept_p = float(sum(first[a] * second[a, guesses[a]] for a in range(vocab)))
    assert 0.05 < accept_p < 0.95, "the test needs both acceptance and rejection"

    engine = engine_for(tiny, max_queued_requests=SAMPLES)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1,
                                          "disable_by_batch_size": 0})
    engine.speculation = Speculation(config, GuessAfter(guesses))

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=3, temperature=TEMPERATURE, seed=10_000 + i,
                              ignore_eos=True)

    outs = [tokens(c) for c in asyncio.run(generate(engine, [prompt] * SAMPLES, sampling))]
    assert all(len(o) == 3 for o in outs)
    accepted = [o for o in outs if o[1] == guesses[o[0]]]
    counters = engine.speculation.counters
    # Most requests' second step verified their guess (not all: after a round in which no
    # running request could speculate, e.g. all prefilling, the backoff skips a few rounds);
    # a guess is accepted only when drawn.
    assert counters.verify_passes >= SAMPLES // 2
    assert 0 < counters.accepted_tokens <= len(accepted)
    # The first two tokens, jointly: p(a) p(b | a).
    joint = {(a, b): SAMPLES * float(first[a] * second[a, b])
             for a in range(vocab) if SAMPLES * float(first[a]) >= 1 for b in range(vocab)}
    assert chi_square_p(Counter((o[0], o[1]) for o in outs), joint) > ALPHA
    # A biased acceptance would show here first: the guess drawn far more often than p says.
    sigma = (accept_p * (1 - accept_p) / SAMPLES) ** 0.5
    assert abs(len(accepted) / SAMPLES - accept_p) < 5 * sigma
    # After an accepted guess, the verify pass's next row: the third token after the likeliest
    # first token and its guess.
    a = int(first.argmax())
    third = next_probs(tiny, [prompt + [a, guesses[a]]])[0]
    thirds = Counter(o[2] for o in accepted if o[0] == a)
    n = sum(thirds.values())
    assert n >= 100, n
    assert chi_square_p(thirds, {t: n * float(third[t]) for t in range(vocab)}) > ALPHA
