"""Speculative decoding's pieces alone: config parsing and the n-gram proposer (verification
runs in the engine: tests/unit/test_speculative_engine.py)."""
from __future__ import annotations

import random

import pytest

from tandem.engines.speculative.config import SpeculativeConfig
from tandem.engines.speculative.ngram import NgramParams, NgramState, propose_stateless
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
