"""Speculative decoding's core pieces alone: config parsing, the n-gram proposer, verification.

The sampling tests are statistical with fixed seeds (so deterministic); each is paired with a
deliberately wrong rule that the same check must reject, so the check can fail.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from scipy.stats import chi2

from tandem.engines.speculative import rejection
from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.ngram import NgramParams, NgramState, propose_stateless
from tandem.engines.speculative.rejection import Verification, verify_greedy, verify_sampled
from tandem.errors import InvalidRequest

# ---------------------------------------------------------------- config


def test_config_ngram_defaults_and_one_bound() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.model) == (5, 5, None)
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 4, 4)
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,'
        ' "prompt_lookup_max": 6}'
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 6)
    assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_config_model_methods(method: str) -> None:
    cfg = SpeculativeConfig.parse(
        f'{{"method": "{method}", "num_speculative_tokens": 2, "model": "/m/draft"}}'
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.model) == (method, 2, "/m/draft")
    assert cfg.prompt_lookup_min is None and cfg.prompt_lookup_max is None
    assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{method: ngram}", "not valid JSON"),
        ('["ngram", 4]', "must be a JSON object"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "unknown key"),
        ('{"num_speculative_tokens": 4}', "method must be one of"),
        ('{"method": "medusa", "num_speculative_tokens": 4}', "'ngram', 'draft_model', 'eagle3'"),
        ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2.5}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be in [1, 16]"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "must be in [1, 16]"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,'
            ' "prompt_lookup_max": 3}',
            "prompt_lookup_max (3) must be >= prompt_lookup_min (4)",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', ">= 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "takes no 'model'"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
        ('{"method": "eagle3", "num_speculative_tokens": 2, "model": " "}', "needs 'model'"),
        (
            '{"method": "eagle3", "num_speculative_tokens": 2, "model": "m",'
            ' "prompt_lookup_max": 3}',
            "apply to method 'ngram' only",
        ),
    ],
)
def test_config_errors(text: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SpeculativeConfig.parse(text)
    assert info.value.param == "speculative_config"
    assert fragment in info.value.message


# ---------------------------------------------------------------- n-gram proposer


def propose_both(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Both implementations, which must agree."""
    params = NgramParams(min_n, max_n, k)
    incremental = NgramState(params, tokens).propose()
    assert propose_stateless(tokens, params) == incremental
    return incremental


def test_ngram_longest_match_wins() -> None:
    # (1, 2, 3) occurred at 0 (followed by 10); the 1-gram (3) more recently at 5 (then 20).
    tokens = [1, 2, 3, 10, 11, 3, 20, 21, 1, 2, 3]
    assert propose_both(tokens, 1, 3, 4) == [10, 11, 3, 20]
    assert propose_both(tokens, 1, 1, 4) == [20, 21, 1, 2]


def test_ngram_most_recent_occurrence_and_k_cap() -> None:
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert propose_both(tokens, 2, 2, 2) == [6, 1]
    # Fewer than k when the occurrence is near the end of the context.
    assert propose_both(tokens, 2, 2, 5) == [6, 1, 2]
    # A repeat overlapping the suffix itself: (7, 7) last occurred at 1, followed by 7.
    assert propose_both([7, 7, 7], 1, 2, 4) == [7]


def test_ngram_nothing_without_a_match() -> None:
    assert propose_both([1, 2, 3, 4], 1, 3, 4) == []
    assert propose_both([], 1, 3, 4) == []
    assert propose_both([5], 1, 3, 4) == []
    # (1, 2) recurs but min_n = 3 asks for more: (9, 1, 2) never occurred before.
    assert propose_both([5, 1, 2, 9, 1, 2], 3, 4, 4) == []
    assert propose_both([5, 1, 2, 9, 1, 2], 2, 4, 4) == [9, 1, 2]


@pytest.mark.parametrize(("min_n", "max_n", "vocab"), [(1, 3, 4), (2, 5, 3), (3, 3, 6)])
def test_ngram_incremental_equals_stateless(min_n: int, max_n: int, vocab: int) -> None:
    """Appending in chunks of every size (one by one and through the bulk path) proposes what a
    fresh scan of the context proposes, after every append."""
    rng = random.Random(min_n * 100 + max_n)
    params = NgramParams(min_n, max_n, 3)
    state = NgramState(params)
    tokens: list[int] = []
    while len(tokens) < 600:
        chunk = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5, 40]))]
        tokens += chunk
        state.extend(chunk)
        assert state.num_tokens == len(tokens)
        assert state.propose() == propose_stateless(tokens, params), len(tokens)
        assert state.propose(1) == state.propose()[:1]


# ---------------------------------------------------------------- greedy verification


def toy_logits(table: torch.Tensor, context: list[int]) -> torch.Tensor:
    """A deterministic 'target model': next-token logits from the last two tokens."""
    return table[context[-1]] + 0.5 * table[(context[-2] * 7 + 3) % table.shape[0]]


@pytest.mark.parametrize("proposer", ["ngram", "noisy_oracle"])
def test_greedy_verification_equals_plain_greedy(proposer: str) -> None:
    vocab, steps, k = 12, 80, 4
    torch.manual_seed(1)
    table = torch.randn(vocab, vocab)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    plain = list(prompt)
    while len(plain) < len(prompt) + steps:
        plain.append(int(toy_logits(table, plain).argmax()))

    rng = random.Random(2)
    spec = list(prompt)
    state = NgramState(NgramParams(1, 3, k), prompt)
    accepted = rejected = 0
    while len(spec) < len(prompt) + steps:
        if proposer == "ngram":
            proposal = state.propose()
        else:  # the true continuation, with some tokens corrupted
            truth = plain[len(spec) : len(spec) + k]
            proposal = [t if rng.random() < 0.7 else rng.randrange(vocab) for t in truth]
        rows = [toy_logits(table, spec + proposal[:i]) for i in range(len(proposal) + 1)]
        result = verify_greedy(torch.stack(rows), torch.tensor(proposal, dtype=torch.int64))
        assert len(result.token_ids) == result.num_accepted + 1
        accepted += result.num_accepted
        rejected += result.num_accepted < len(proposal)
        spec += result.token_ids
        state.extend(result.token_ids)
    assert spec[: len(plain)] == plain
    assert accepted > 0 and rejected > 0  # both paths were exercised


def test_greedy_all_accepted_adds_bonus() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    assert verify_greedy(logits, torch.tensor([1, 2])) == Verification([1, 2, 0], 2)
    assert verify_greedy(logits, torch.tensor([1, 0])) == Verification([1, 2], 1)
    assert verify_greedy(logits[:1], torch.tensor([], dtype=torch.int64)) == Verification([1], 0)
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_greedy(logits, torch.tensor([1]))


# ---------------------------------------------------------------- sampled verification

VOCAB = 6
DRAWS = 3000
#: Chi-square critical values at a 1e-3 false-alarm rate; the wrong rules land far above.
ALPHA = 1e-3


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value) of a goodness-of-fit test; cells of tiny mass are pooled."""
    expected = expected_probs.flatten() * counts.sum()
    counts = counts.flatten().to(expected.dtype)
    big = expected >= 5
    stat = float((((counts[big] - expected[big]) ** 2) / expected[big]).sum())
    cells = int(big.sum())
    if not bool(big.all()):
        rest_e, rest_c = expected[~big].sum(), counts[~big].sum()
        stat += float((rest_c - rest_e) ** 2 / rest_e)
        cells += 1
    return stat, float(chi2.ppf(1 - ALPHA, cells - 1))


def distributions(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked-ish target p and a different draft q, [rows, VOCAB] each."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(rows, VOCAB, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(1.5 * torch.randn(rows, VOCAB, generator=g, dtype=torch.float64), -1)
    return p, q


def first_token_counts(p: torch.Tensor, q: torch.Tensor | None, seed: int) -> torch.Tensor:
    """How often each token comes first out of verification, over DRAWS proposals of k = 2
    (drawn from q, or the fixed proposal [1, 4] for a deterministic proposer)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    fixed = torch.tensor([1, 4])
    for _ in range(DRAWS):
        proposal = fixed if q is None else torch.multinomial(q, 1, generator=g).flatten()
        counts[verify_sampled(p, proposal, q, g).token_ids[0]] += 1
    return counts


@pytest.mark.parametrize("deterministic", [True, False])
def test_sampled_first_token_follows_target(deterministic: bool) -> None:
    p, q = distributions(3, 3)
    draft = None if deterministic else q[:2]
    stat, critical = chi_square(first_token_counts(p, draft, seed=4), p[0])
    assert stat < critical, (stat, critical)


@pytest.mark.parametrize(
    ("deterministic", "wrong"),
    [
        (True, "accept_always"),
        (True, "residual_is_p"),
        (False, "accept_always"),
        (False, "residual_is_p"),
    ],
)
def test_sampled_check_rejects_wrong_rules(
    deterministic: bool, wrong: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same check, with verification's acceptance or residual deliberately broken."""
    rules: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
        "accept_always": ("acceptance_probability", lambda p_x, q_x: torch.ones_like(p_x)),
        # Forgetting to subtract q: re-draws from p after a rejection, over-weighting x.
        "residual_is_p": ("residual_distribution", lambda p, q, rejected_id: p),
    }
    name, rule = rules[wrong]
    monkeypatch.setattr(rejection, name, rule)
    p, q = distributions(3, 3)
    draft = None if deterministic else q[:2]
    stat, critical = chi_square(first_token_counts(p, draft, seed=4), p[0])
    assert stat > 3 * critical, (stat, critical)


def test_sampled_token_pairs_follow_target() -> None:
    """The first two emitted tokens, over as many verify passes as that takes, follow
    p_0 x p_1 (a target whose position j draws from p_j whatever came before): covers accepted
    prefixes, corrections and bonus tokens at every offset."""
    k = 2
    p, q = distributions(5, 2 + k)
    g = torch.Generator().manual_seed(6)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.int64)
    lengths = set()
    for _ in range(DRAWS):
        out: list[int] = []
        while len(out) < 2:
            at = len(out)
            proposal = torch.multinomial(q[at : at + k], 1, generator=g).flatten()
            result = verify_sampled(p[at : at + k + 1], proposal, q[at : at + k], g)
            lengths.add(len(result.token_ids))
            out += result.token_ids
        counts[out[0], out[1]] += 1
    assert lengths == {1, 2, 3}
    stat, critical = chi_square(counts, p[0][:, None] * p[1][None, :])
    assert stat < critical, (stat, critical)


def test_sampled_agrees_with_greedy_limits() -> None:
    """One-hot targets leave nothing to chance: accept exactly the argmax-matching prefix."""
    p = torch.eye(VOCAB, dtype=torch.float64)[[1, 2, 3]]
    g = torch.Generator().manual_seed(0)
    assert verify_sampled(p, torch.tensor([1, 2]), None, g) == Verification([1, 2, 3], 2)
    assert verify_sampled(p, torch.tensor([1, 5]), None, g) == Verification([1, 2], 1)
    q = torch.full((2, VOCAB), 1.0 / VOCAB, dtype=torch.float64)
    assert verify_sampled(p, torch.tensor([0, 2]), q, g) == Verification([1], 0)


def test_sampled_is_reproducible() -> None:
    p, q = distributions(7, 4)
    proposal = torch.tensor([0, 1, 2])
    runs = [
        [verify_sampled(p, proposal, q[:3], g) for _ in range(50)]
        for g in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))
    ]
    assert runs[0] == runs[1]
