"""A deterministic stand-in for a language model: the next token is a hash of every token
before it, so an aggregated run and a context-only + generation-only run agree token for token,
in one process or two."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

from tensorrt_llm.executor.result import Logprob

INITIAL_STATE = 0


def advance(state: int, token: int) -> int:
    digest = hashlib.blake2b(state.to_bytes(8, "little") + token.to_bytes(4, "little"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little")


def fold(tokens: Iterable[int], state: int = INITIAL_STATE) -> int:
    for token in tokens:
        state = advance(state, token)
    return state


def sample(state: int, vocab_size: int) -> int:
    return state % vocab_size


def logprobs(state: int, token: int, k: int, vocab_size: int) -> dict[int, Logprob]:
    """The sampled token ranks first; k - 1 made-up alternatives follow."""
    top = -((state >> 16) % 1000) / 1000.0
    out = {token: Logprob(top, 1)}
    for i in range(1, k):
        out[(token + i) % vocab_size] = Logprob(top - i, i + 1)
    return out
