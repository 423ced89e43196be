"""The n-gram (prompt lookup) proposer: no weights, only the request's own context.

Rule: among suffixes of the context of length n in [min_n, max_n], take the longest one that
also occurred earlier (an occurrence with at least one token after it), and propose the (up to)
k tokens that followed its MOST RECENT earlier occurrence. Nothing is proposed when no suffix
matches. Fewer than k tokens come back when that occurrence is close to the end of the context.

Two implementations of the same rule:

- `NgramState`, per request and incremental: for each n a dict from an n-gram to where the
  token after its latest occurrence sits. Appending a token adds (max_n - min_n + 1) entries and
  a proposal is (max_n - min_n + 1) dict look-ups, so a step costs O(max_n^2) whatever the
  context length (measured with n in [1, 5] on a 30k-token context: ~3 us to append a token,
  ~1.5 us to propose). The prompt's entries are built once through `dict.update` (~20 ms per n
  for 30k tokens). Memory: roughly 100-200 bytes per token and n (30k tokens, n in [1, 5]:
  ~25 MB; vLLM's default n = 5 alone: ~5 MB).
- `propose_stateless`, a numpy scan over the whole context per call (one vectorised compare
  over L tokens, then filters of the few candidates; no state; ~40 us on 30k tokens given as an
  int64 array, most of 2 ms converting them when given as a list), the reference the tests hold `NgramState` to and a fallback for one-off calls.

The state only ever sees accepted tokens (the engine appends after verification), so it never
needs rolling back.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

#: Up to this many tokens appended at once are indexed one by one; more go through dict.update.
_FEW = 32


@dataclass(frozen=True, slots=True)
class NgramParams:
    """The proposer's settings (from SpeculativeConfig: prompt_lookup_min/max and
    num_speculative_tokens)."""

    min_n: int
    max_n: int
    #: The most tokens one proposal holds.
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n or self.num_speculative_tokens < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and k >= 1: {self}")


class NgramState:
    """One request's context and its n-gram index; owned by that request only.

    Contract: `extend` with every token the request has (prompt first, then each accepted
    output token, in order); `propose` reads the context as it stands.
    """

    __slots__ = ("params", "_tokens", "_index")

    def __init__(self, params: NgramParams, token_ids: Iterable[int] = ()) -> None:
        self.params = params
        self._tokens: list[int] = []
        # _index[n - min_n][ngram] = the position of the token that followed the latest
        # occurrence of `ngram` whose follower is already in the context.
        self._index: list[dict[tuple[int, ...], int]] = [
            {} for _ in range(params.min_n, params.max_n + 1)
        ]
        self.extend(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Appends tokens to the context and indexes the n-grams they complete."""
        old = len(self._tokens)
        self._tokens.extend(token_ids)
        new = len(self._tokens)
        if new == old:
            return
        tokens = self._tokens
        if new - old <= _FEW:
            # A decode step appends one to k + 1 tokens: plain assignments beat the bulk path's
            # per-call setup (~4x at one token).
            for follower in range(old, new):
                for n, index in enumerate(self._index, start=self.params.min_n):
                    if follower >= n:
                        index[tuple(tokens[follower - n : follower])] = follower
            return
        for n, index in enumerate(self._index, start=self.params.min_n):
            # An occurrence starting at s is indexed once its follower s + n exists (s + n < new);
            # the ones with s + n < old are in already.
            first = max(0, old - n)
            last = new - n  # exclusive
            if last <= first:
                continue
            # Keys zipped from n shifted slices; update() keeps the last (most recent) position.
            keys = zip(*(tokens[first + i : last + i] for i in range(n)))
            index.update(zip(keys, range(first + n, last + n)))

    def propose(self, k: int | None = None) -> list[int]:
        """Up to k (default: params.num_speculative_tokens) proposed next tokens; [] when no
        suffix of length in [min_n, max_n] occurred earlier."""
        k = self.params.num_speculative_tokens if k is None else k
        tokens = self._tokens
        length = len(tokens)
        for n in range(min(self.params.max_n, length - 1), self.params.min_n - 1, -1):
            follower = self._index[n - self.params.min_n].get(tuple(tokens[length - n :]))
            if follower is not None:
                return tokens[follower : follower + k]
        return []


def propose_stateless(token_ids: Sequence[int] | np.ndarray, params: NgramParams) -> list[int]:
    """The same rule as NgramState.propose, by scanning the context (no state kept)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    length = int(arr.shape[0])
    if length < params.min_n + 1:
        return []
    # Ends e of earlier occurrences of the last token (e <= length - 2, so each has a
    # follower): one vectorised compare over the context, then every longer suffix only
    # filters this (usually short) list further.
    ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
    best = None
    for n in range(1, min(params.max_n, length - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[arr[ends - (n - 1)] == arr[length - n]]
        if ends.size == 0:
            break
        if n >= params.min_n:
            best = int(ends[-1]) + 1  # the follower of the latest occurrence of this length
    if best is None:
        return []
    return [int(t) for t in arr[best : best + params.num_speculative_tokens]]
