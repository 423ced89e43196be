"""The mock engine's guided draws: a token among those the request's grammar allows, picked
from the same (key, position) stream as unconstrained draws, so a guided load test gets outputs
that satisfy their constraints and end in tens of tokens."""
from __future__ import annotations

from collections.abc import Sequence

from tandem.engines.batching.request import BatchRequest
from tandem.engines.guided.matcher import Grammars, allowed_ids, fill_bitmask
from tandem.engines.mock.sampler import mix64

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
#: Bytes that close a JSON string, object or array (or a group), and other punctuation that
#: moves a pattern on without opening anything.
_CLOSING = b'"}])'
_PUNCT = b"!#$%&'*+-./:;<=>?@\\^_`|~"


def draw_allowed(key: int, position: int, allowed: Sequence[int],
                 tiers: Sequence[frozenset[int]]) -> int:
    """The token at output `position` for stream `key` among the ids a grammar `allowed`
    (ascending, not empty). `tiers` are token sets to prefer, most wanted first (stop tokens,
    then closing tokens, then other punctuation); the later the position, the likelier an
    allowed token of an early tier. Otherwise any allowed token but a stop token."""
    r = mix64((key + (position + 1) * _GOLDEN) & _MASK)
    for shift, tier in enumerate(tiers):
        wanted = [t for t in allowed if t in tier]
        if wanted and (len(wanted) == len(allowed) or (r >> (3 + 6 * shift)) % 64 < position):
            return wanted[r % len(wanted)]
    stops = tiers[0] if tiers else frozenset()
    others = [t for t in allowed if t not in stops] or list(allowed)
    return others[r % len(others)]


class GuidedDraws:
    """Draws for the guided requests of a step (one bitmask for the batch)."""

    def __init__(self, grammars: Grammars, stop_ids: frozenset[int]) -> None:
        vocab = grammars.decoded_vocab
        self.vocab_size = grammars.vocab_size
        #: Preferred as an output grows: EOS; tokens made only of closing bytes; tokens made
        #: only of other punctuation (no opener, no comma).
        self.tiers = (
            stop_ids,
            frozenset(i for i, text in enumerate(vocab) if text and not text.strip(_CLOSING)),
            frozenset(i for i, text in enumerate(vocab) if text and not text.strip(_PUNCT)))

    def draw(self, ready: Sequence[BatchRequest]) -> dict[int, int]:
        """Row in `ready` -> token, for each guided request."""
        bitmask = fill_bitmask([req.guide for req in ready], self.vocab_size)
        if bitmask is None:
            return {}
        return {row: draw_allowed(req.key, req.num_output,
                                  allowed_ids(bitmask, row, self.vocab_size), self.tiers)
                for row, req in enumerate(ready) if req.guide is not None}
