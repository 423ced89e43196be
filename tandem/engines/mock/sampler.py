"""Deterministic output tokens for the mock engine: the token at output position i is a pure
function of (seed or prompt, i), so a prompt always yields the same text on every worker."""
from __future__ import annotations

import hashlib
import json
import pathlib
from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from tandem.engines.types import TokenLogprob, TopLogprob

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
#: Fewer draws than this go one by one (numpy's per-call cost is larger there).
_MIN_VECTOR = 8


def mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def stream_key(prompt_token_ids: Sequence[int], seed: int | None) -> int:
    """The 64-bit key a request's output tokens derive from: its seed when set, else its prompt."""
    if seed is not None:
        return mix64((seed * _GOLDEN + 1) & _MASK)
    packed = array("q", prompt_token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def special_token_ids(model_dir: str | pathlib.Path) -> set[int]:
    """Ids of the `added_tokens` marked special in the model's tokenizer.json (empty if none)."""
    path = pathlib.Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return set()
    raw = json.loads(path.read_text())
    return {int(t["id"]) for t in raw.get("added_tokens") or () if t.get("special")}


class TokenSampler:
    """Maps (key, position) to a token id in [0, vocab_size) minus the excluded ids (EOS and
    special tokens), and produces plausible, deterministic logprobs for it."""

    def __init__(self, vocab_size: int, excluded: Iterable[int]) -> None:
        skip = {t for t in excluded if 0 <= t < vocab_size}
        self.allowed: list[int] = [t for t in range(vocab_size) if t not in skip]
        if not self.allowed:
            raise ValueError("every token id of the vocabulary is excluded")
        self._allowed = np.array(self.allowed, dtype=np.int64)

    def draw(self, key: int, position: int) -> int:
        """The token at output `position` for stream `key`."""
        allowed = self.allowed
        return allowed[mix64((key + (position + 1) * _GOLDEN) & _MASK) % len(allowed)]

    def draw_many(self, keys: Sequence[int], positions: Sequence[int]) -> list[int]:
        """`draw` of each (key, position), in numpy's wrapping uint64 arithmetic: ~4x less CPU
        than one `draw` each for a step of 128 streams (the mock's share of a worker's step)."""
        if len(keys) < _MIN_VECTOR:
            return [self.draw(k, p) for k, p in zip(keys, positions, strict=True)]
        x = (np.array(keys, dtype=np.uint64)
             + (np.array(positions, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        tokens: list[int] = self._allowed[x % np.uint64(len(self.allowed))].tolist()
        return tokens

    def logprob(self, key: int, position: int, token_id: int, k: int) -> TokenLogprob:
        """The sampled token's logprob (<= 0) and `k` alternatives sorted best first; the sampled
        token leads the list when it is the most likely."""
        r = mix64(((key ^ 0x5DEECE66D) + position * _GOLDEN) & _MASK)
        # Rank of the sampled token among the candidates: best about 3 times in 4.
        rank = 0 if r & 3 else 1 + (r >> 2) % (k + 1)
        values: list[float] = []
        lp = -((r >> 8) % 1000) / 2000.0  # best logprob in (-0.5, 0]
        for j in range(max(k, rank + 1)):
            values.append(lp)
            lp -= 0.25 + ((r >> (16 + 3 * (j % 12))) & 7) / 8.0
        sampled_lp = values[rank]
        top: list[TopLogprob] = []
        allowed = self.allowed
        n = len(allowed)
        alt = (r >> 20) % n
        for j in range(k):
            if j == rank:
                top.append(TopLogprob(token_id, values[j]))
                continue
            candidate = allowed[alt % n]
            alt += 1
            if candidate == token_id:
                candidate = allowed[alt % n]
                alt += 1
            top.append(TopLogprob(candidate, values[j]))
        return TokenLogprob(token_id, sampled_lp, tuple(top))
