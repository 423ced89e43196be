"""Token ids of long prompts' shared beginnings, kept so that only what follows them is encoded.

Long prompts repeat: a system prompt, a document, the turns of a conversation so far. Encoding a
prompt of 4,000 tokens costs milliseconds of CPU, most of it on text the frontend encoded for
the last request. So when a long text's encoding is computed, its token ids are kept together
with cut points: positions a little past every `chunk_chars` characters where the text has a
space after a letter or digit and no token spans the position. A later text that begins with the same
characters up to one of those cut points reuses the ids before it and encodes only the rest.

Why those cut points: the pre-tokenizers of byte-level BPE (GPT-2, Llama 3, Qwen), Metaspace
and whitespace tokenizers split text before a space that follows a word, so no token spans
one, and what comes after cannot change the tokens before it. That holds for the tokenizers
Tandem has met but is not guaranteed for every tokenizer.json, so it is checked rather than
trusted: the first reuse of every kept text is compared with a full encoding, and one mismatch
turns the cache off for good (a warning says so); a tokenizer with truncation or padding
configured never uses it.

Keys are (cut point, a chained hash of the text before it: each cut's hash covers the last one's
and the characters between, Python's salted hashes, so all of a text's keys cost one pass over
it); values share one kept ids tuple per text. At most `max_cuts` cut points per text (the
first ones) and `max_texts` texts, least recently used first out.
"""
from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Kept:
    """One text's token ids, shared by its cut points."""

    ids: tuple[int, ...]
    #: Whether a reuse was checked against a full encoding.
    verified: bool = False


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest kept beginning of a text: ids of text[:cut]."""

    cut: int
    ids: tuple[int, ...]
    kept: _Kept


class PrefixTokenCache:
    def __init__(self, backend: tokenizers.Tokenizer, max_texts: int = 256,
                 chunk_chars: int = 1024, max_cuts: int = 256) -> None:
        self.backend = backend
        self.max_texts = max_texts
        self.chunk_chars = chunk_chars
        self.max_cuts = max_cuts
        #: (cut, chained hash of text[:cut]) -> (the text's kept ids, token index at the cut).
        self._cuts: dict[tuple[int, int], tuple[_Kept, int]] = {}
        #: Kept texts in least recently used order, each with its keys.
        self._texts: collections.OrderedDict[int, tuple[_Kept, list[tuple[int, int]]]] = \
            collections.OrderedDict()
        self.enabled = backend.truncation is None and backend.padding is None
        self.num_hits = 0

    def cut_points(self, text: str) -> list[tuple[int, int]]:
        """(position, key) of the positions past every `chunk_chars` characters where a space
        follows a letter or digit, ascending (at most one per chunk, `max_cuts` in all)."""
        cuts: list[tuple[int, int]] = []
        start, last, chained = self.chunk_chars, 0, 0
        while start < len(text) and len(cuts) < self.max_cuts:
            i = text.find(" ", start)
            while i > 0 and not text[i - 1].isalnum():
                i = text.find(" ", i + 1)
            if i <= 0:
                break
            chained = hash((chained, text[last:i]))
            cuts.append((i, chained))
            last = i
            start = max(i + 1, (i // self.chunk_chars + 1) * self.chunk_chars)
        return cuts

    def lookup(self, text: str) -> PrefixHit | None:
        """The longest cut point of `text` whose beginning is kept; None when none is."""
        if not self.enabled:
            return None
        for cut, key in reversed(self.cut_points(text)):
            found = self._cuts.get((cut, key))
            if found is not None:
                kept, index = found
                self._texts.move_to_end(id(kept))
                return PrefixHit(cut, kept.ids[:index], kept)
        return None

    def keep(self, text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]]) -> None:
        """Keeps `text`'s encoding (ids without added special tokens, and their character
        offsets) under every cut point that no token spans."""
        if not self.enabled:
            return
        kept = _Kept(tuple(ids))
        keys = []
        for cut, chained in self.cut_points(text):
            index = bisect.bisect_left(offsets, (cut, -1))  # the first token from `cut` on
            if index == 0 or offsets[index - 1][1] <= cut:  # and none spans it
                key = (cut, chained)
                self._cuts[key] = (kept, index)
                keys.append(key)
        if not keys:
            return
        self._texts[id(kept)] = (kept, keys)
        while len(self._texts) > self.max_texts:
            _, (_, old_keys) = self._texts.popitem(last=False)
            for key in old_keys:
                self._cuts.pop(key, None)

    def check(self, hit: PrefixHit, ids: list[int], full: list[int]) -> bool:
        """A first reuse of `hit` gave `ids` where the full encoding is `full`: True when they
        agree (the kept text is trusted from now on); False turns the cache off."""
        if ids == full:
            hit.kept.verified = True
            return True
        self.enabled = False
        self._cuts.clear()
        self._texts.clear()
        log.warning("this tokenizer splits text differently around cut points: the prefix "
                    "token cache is off (every prompt is encoded whole)",
                    extra={"cut": hit.cut})
        return False
