"""The reference engine's sampler: greedy, seeded draws, filters, penalties, min_tokens, logprobs."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from tandem.engines.reference.sampler import SampleInput, Sampler, draw_seed, prompt_logprobs
from tandem.engines.types import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def row(params: SamplingParams, *, prompt: Sequence[int] = (1, 2), output: Sequence[int] = (),
        stop: frozenset[int] = frozenset(), seed: int = 0) -> SampleInput:
    return SampleInput(params=params, prompt_ids=prompt, output_ids=output, stop_ids=stop,
                       seed=seed)


def sp(**kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kwargs)  # type: ignore[arg-type]


def tokens(sampler: Sampler, logits: torch.Tensor, inputs: Sequence[SampleInput]) -> list[int]:
    return [o.token_id for o in sampler.sample(logits, inputs)]


def chi_square(counts: Counter[int], probs: list[float], n: int) -> float:
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(probs) if p > 0)


def test_greedy_is_argmax_with_lowest_id_on_ties(device: torch.device) -> None:
    logits = torch.randn(6, 50, device=device)
    logits[5, 7] = logits[5, 30] = 100.0  # a tie: the lower id wins
    got = tokens(Sampler(device), logits, [row(sp(temperature=0.0))] * 6)
    assert got == logits.argmax(dim=-1).tolist()
    assert got[5] == 7


def test_caller_logits_are_not_modified(device: torch.device) -> None:
    logits = torch.randn(2, 20, device=device)
    before = logits.clone()
    params = sp(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.5,
                frequency_penalty=0.3, presence_penalty=0.2, min_tokens=4, top_logprobs=2)
    Sampler(device).sample(logits, [row(params, output=(3, 4), stop=frozenset({5})),
                                    row(sp(temperature=0.0), output=(1,))])
    assert torch.equal(logits, before)


def test_seeded_draw_ignores_batch_neighbours(device: torch.device) -> None:
    sampler = Sampler(device)
    gen = torch.Generator().manual_seed(1)
    target = sp(temperature=0.9, top_p=0.95)
    neighbours = [sp(temperature=0.0), sp(temperature=1.3, top_k=3),
                  sp(temperature=0.5, min_p=0.2, top_logprobs=2),
                  sp(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5)]
    seen = set()
    for seed in range(40):
        logits = torch.randn(5, 64, generator=gen).to(device)
        alone = tokens(sampler, logits[2:3], [row(target, seed=seed, output=(9,))])[0]
        batch = [row(p, seed=seed + 100 + j, output=(5, 6)) for j, p in enumerate(neighbours)]
        batch.insert(2, row(target, seed=seed, output=(9,)))
        together = tokens(sampler, logits, batch)[2]
        again = tokens(sampler, logits[2:3], [row(target, seed=seed, output=(9,))])[0]
        assert alone == together == again
        seen.add(alone)
    assert len(seen) > 5  # the draws are random, not a constant


def test_draw_depends_only_on_seed_and_position(device: torch.device) -> None:
    sampler = Sampler(device)
    logits = torch.zeros(1, 1000, device=device)  # uniform: any change of noise shows
    params = sp(temperature=1.0)
    first = tokens(sampler, logits, [row(params, seed=7, prompt=(1,), output=(4, 4, 4))])[0]
    # Other draws in between, other prompt and output contents at the same position.
    tokens(sampler, logits.expand(8, -1), [row(params, seed=s) for s in range(8)])
    same = tokens(sampler, logits, [row(params, seed=7, prompt=(3, 2, 1), output=(8, 9, 0))])[0]
    assert same == first
    by_position = [tokens(sampler, logits, [row(params, seed=7, output=(0,) * i)])[0]
                   for i in range(20)]
    assert len(set(by_position)) > 10
    by_seed = [tokens(sampler, logits, [row(params, seed=s, output=(0,) * 3)])[0]
               for s in range(20)]
    assert len(set(by_seed)) > 10
    assert draw_seed(7, 3) != draw_seed(7, 4) != draw_seed(8, 3)


@pytest.mark.parametrize("params", [sp(temperature=1.0, top_k=1),
                                    sp(temperature=1.0, top_p=1e-6),
                                    sp(temperature=2.0, top_k=4, top_p=1e-6)])
def test_narrow_filters_equal_greedy(device: torch.device, params: SamplingParams) -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(2)).to(device)
    inputs = [row(params, seed=s) for s in range(32)]
    assert tokens(Sampler(device), logits, inputs) == logits.argmax(dim=-1).tolist()


def test_min_p_never_draws_masked_tokens(device: torch.device) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    n = 3000
    logits = probs.log().expand(n, -1).to(device)
    # threshold 0.1 * 0.5 = 0.05: tokens 3 and 4 are out.
    got = Counter(tokens(Sampler(device), logits, [row(sp(min_p=0.1), seed=s) for s in range(n)]))
    assert got[3] == got[4] == 0
    assert chi_square(got, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0, 0], n) < 13.8  # df 2, p .001


def test_penalties_match_hand_computed_logits(device: torch.device) -> None:
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]], device=device)
    params = sp(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                presence_penalty=0.25)
    inputs = [row(params, prompt=(0,), output=(1, 3, 3)), row(sp(temperature=0.0), output=(3,))]
    got = Sampler(device)._apply_penalties(raw, inputs)
    # Repetition over prompt+output {0, 1, 3}: 2 -> 1, -1 -> -2, 3 -> 1.5.
    # Then output counts {1: 1, 3: 2}: token 1 -= 0.5 + 0.25, token 3 -= 1.0 + 0.25.
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    torch.testing.assert_close(got.cpu(), expected)
    # The argmax moves from token 3 to token 0 for the penalised row only.
    assert tokens(Sampler(device), raw, inputs) == [0, 3]


def test_min_tokens_blocks_stop_ids_until_reached(device: torch.device) -> None:
    sampler = Sampler(device)
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2, 30.0]], device=device)
    for params in (sp(temperature=0.0, min_tokens=3), sp(temperature=1.0, min_tokens=3)):
        for n_out in range(5):
            got = tokens(sampler, logits, [row(params, output=(1,) * n_out,
                                               stop=frozenset({4, 3}), seed=n_out)])[0]
            if n_out < 3:
                assert got not in (3, 4)
            else:
                assert got == 4


def test_logprobs_are_raw_log_softmax_with_k_best_first(device: torch.device) -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)).to(device)
    params = sp(temperature=0.7, top_k=5, repetition_penalty=1.4, presence_penalty=0.5,
                top_logprobs=4)
    inputs = [row(params, output=(1, 2), seed=11), row(sp(temperature=0.0)),
              row(sp(temperature=0.0, top_logprobs=0, frequency_penalty=1.0), output=(5,))]
    out = Sampler(device).sample(logits, inputs)
    ref = torch.log_softmax(logits.cpu().double(), dim=-1)
    assert out[1].logprob is None
    for i in (0, 2):
        lp = out[i].logprob
        assert lp is not None and lp.token_id == out[i].token_id
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
    assert out[2].logprob is not None and out[2].logprob.top == ()
    top = out[0].logprob.top  # type: ignore[union-attr]
    assert len(top) == 4
    assert [t.token_id for t in top] == ref[0].topk(4).indices.tolist()
    values = [t.logprob for t in top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(ref[0].topk(4).values.tolist(), abs=1e-5)


def test_prompt_logprobs_match_log_softmax(device: torch.device) -> None:
    prompt = [5, 17, 3, 3, 29, 0]
    logits = torch.randn(len(prompt) - 1, 32, generator=torch.Generator().manual_seed(4))
    got = prompt_logprobs(logits.to(device), prompt, k=3)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert [g.token_id for g in got] == prompt[1:]
    for j, g in enumerate(got):
        assert g.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=1e-5)
        assert [t.token_id for t in g.top] == ref[j].topk(3).indices.tolist()
        assert [t.logprob for t in g.top] == pytest.approx(ref[j].topk(3).values.tolist(),
                                                           abs=1e-5)
    assert all(g.top == () for g in prompt_logprobs(logits.to(device), prompt, k=0))
    assert prompt_logprobs(logits[:0].to(device), prompt[:1], k=2) == []
    with pytest.raises(ValueError):
        prompt_logprobs(logits.to(device), prompt[:-1], k=1)


@pytest.mark.parametrize(("params", "expected"), [
    # softmax([0, 1, 2, -1]) ~ [0.087, 0.237, 0.644, 0.032]
    (sp(temperature=1.0), torch.softmax(torch.tensor([0.0, 1.0, 2.0, -1.0]), 0).tolist()),
    (sp(temperature=0.5), torch.softmax(torch.tensor([0.0, 2.0, 4.0, -2.0]), 0).tolist()),
    # top_k 2 keeps {1, 2}; top_p 0.8 keeps {2, 1} too (0.644 < 0.8 <= 0.881).
    (sp(top_k=2), [0.0, 0.269, 0.731, 0.0]),
    (sp(top_p=0.8), [0.0, 0.269, 0.731, 0.0]),
])
def test_draws_follow_the_distribution(device: torch.device, params: SamplingParams,
                                       expected: list[float]) -> None:
    n = 4000
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0]).expand(n, -1).to(device)
    got = Counter(tokens(Sampler(device), logits, [row(params, seed=s) for s in range(n)]))
    assert all(got[t] == 0 for t, p in enumerate(expected) if p == 0)
    dof = sum(p > 0 for p in expected) - 1
    assert chi_square(got, expected, n) < {1: 10.8, 3: 16.3}[dof]  # p = 0.001


def test_greedy_rows_ignore_seed_and_batch_mix(device: torch.device) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5)).to(device)
    greedy = sp(temperature=0.0)
    mixed = [row(greedy, seed=1), row(sp(temperature=1.0), seed=2), row(greedy, seed=3),
             row(replace(greedy, top_logprobs=1), seed=4)]
    got = tokens(Sampler(device), logits, mixed)
    ref = logits.argmax(dim=-1).tolist()
    assert [got[0], got[2], got[3]] == [ref[0], ref[2], ref[3]]
