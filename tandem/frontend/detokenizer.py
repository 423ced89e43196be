"""Incremental detokenization of one request's output, with stop strings.

Two stages, each holding back text that is not final yet:

1. Decoding. Tokens do not map to characters: a CJK character or an emoji can span several
   byte-level tokens, and SentencePiece decoders drop the leading space of the first token they
   see. So we decode a small window (a few final tokens for context, then the unread ones) and
   emit the part past the context, as vLLM and TGI do with prefix_offset/read_offset. While the
   window's text ends in U+FFFD (an incomplete UTF-8 sequence) we emit only what comes before it,
   and keep the tokens unread until a later chunk completes the character.
2. Stop strings. The text is searched for the stop strings; the longest suffix that could still
   grow into one is held back until the next chunk decides it.

Each add() costs two decodes of a window of about (chunk + 5) tokens, never the whole output.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.frontend.tokenizer import Tokenizer

_FFFD = "\ufffd"
# Final tokens kept before the unread ones as decode context (vLLM keeps 5 as well).
_CONTEXT_TOKENS = 5
# Unread tokens behind an incomplete character that trigger compaction of the window, so a long
# chunk ending mid-character does not make every later decode long.
_COMPACT_AFTER = 16
# Character boundaries tried per compaction, from the end. An incomplete UTF-8 sequence has at most
# 3 bytes, so valid text always has one among the last 4 tokens; more helps with stray bytes.
_COMPACT_TRIES = 8
# Unread tokens after which text still ending in U+FFFD is taken as stray bytes and emitted.
_MAX_UNREAD = 64


class IncrementalDetokenizer:
    """Turns one request's stream of token chunks into text deltas.

    Contract: the concatenation of everything add() and finish() return equals
    `tokenizer.decode(all_ids, skip_special_tokens)` (with prompt context, as the text continues
    the prompt), cut right before the first stop string to complete, if any. Returned text never
    ends inside an incomplete UTF-8 sequence, except in finish(), which flushes what is left.
    Stop strings are matched in the order they complete; once one matches, `stopped` is True
    and add() returns "" for any further tokens. Output that is not valid UTF-8 (a model emitting
    stray bytes) is emitted with U+FFFD once it cannot be a character's start any more.
    Not thread-safe: one instance per request.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = ()) -> None:
        self._decode_fn: Callable[[list[int], bool], str] = tokenizer.backend.decode
        self._skip = skip_special_tokens
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        # A held-back suffix is some stop's proper prefix, so it ends in one of these characters.
        self._stop_prefix_chars = frozenset(c for s in self._stops for c in s[:-1])
        context = list(prompt_ids[-_CONTEXT_TOKENS:]) if len(prompt_ids) else []
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_FFFD):  # the prompt ends mid-character: do not glue onto it
            context, context_text = [], ""
        # Decode window: ids[:read] are final context, the rest are unread.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_len = len(context_text)  # len(decode(ids[:read]))
        self._held = 0  # chars of decode(ids) past the prefix already passed on
        self._stream_len = 0  # chars passed from decoding to the stop-string stage
        self._pending = ""  # decoded text held back as a possible stop-string start
        self._parts: list[str] = []
        self._num_tokens = 0
        self._stopped = False
        self._finished = False
        self._matched_stop: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched; the text ends right before it."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that matched, if any (OpenAI servers report it as stop_reason)."""
        return self._matched_stop

    @property
    def num_tokens(self) -> int:
        """Output tokens consumed: all those added, or, after a stop, those up to and including
        the token that completed the stop string."""
        return self._num_tokens

    @property
    def text(self) -> str:
        """Everything returned so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Consume a chunk of output token ids; return the text that became safe to emit."""
        if self._finished:
            raise RuntimeError("add() after finish()")
        if self._stopped or not len(token_ids):
            return ""
        ids = self._ids  # _step replaces self._ids; this list keeps the pre-step window
        base, consumed, stream = len(ids), self._prefix_len + self._held, self._stream_len
        ids.extend(token_ids)
        delta = self._step(final=False)
        num_before = self._num_tokens
        self._num_tokens += len(token_ids)
        if not self._stops:
            if delta:
                self._parts.append(delta)
            return delta
        out, stop_end = self._filter(delta, final=False)
        if stop_end is not None and len(token_ids) > 1:
            need = consumed + stop_end - stream  # window chars that complete the stop string
            self._num_tokens = num_before + self._tokens_to_reach(ids, base, len(token_ids), need)
        if out:
            self._parts.append(out)
        return out

    def finish(self) -> str:
        """End of generation: return everything still held back (a partial character becomes
        U+FFFD; a partial stop string is emitted as text). Call once."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        if self._stopped:
            return ""
        delta = self._step(final=True)
        out = self._filter(delta, final=True)[0] if self._stops else delta
        if out:
            self._parts.append(out)
        return out

    # -- decoding stage ------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, self._skip)

    def _step(self, final: bool) -> str:
        """Decode the window and return the text that became safe; advance the window."""
        ids = self._ids
        text = self._decode(ids)
        start = self._prefix_len + self._held
        if final or not text.endswith(_FFFD):
            delta = text[start:]
            if final:
                self._reset_window()
            else:
                self._advance(ids, len(ids), 0)
        else:
            safe_len = len(text.rstrip(_FFFD))
            delta = text[start:safe_len]
            self._held += len(delta)
            unread = len(ids) - self._read
            if unread > _COMPACT_AFTER:
                extra = self._compact(ids)
                if extra is not None:
                    delta += extra
                elif unread > _MAX_UNREAD:
                    # Not an incomplete character but a long run of stray bytes: emit them as
                    # U+FFFD (possibly grouped unlike a one-shot decode) and start afresh.
                    delta += text[max(start, safe_len):]
                    self._reset_window()
        self._stream_len += len(delta)
        return delta

    def _advance(self, ids: list[int], end: int, held: int) -> None:
        """Make ids[:end] final (ending on a character boundary); keep ids[end:] unread with
        `held` of their characters already passed on."""
        context_start = max(self._read, end - _CONTEXT_TOKENS)
        context = ids[context_start:end]
        context_text = self._decode(context)
        if context_start > self._read and context_text.startswith(_FFFD):
            # The cut fell inside a character; start at the previous boundary instead.
            context = ids[self._read:end]
            context_text = self._decode(context)
        self._ids = context + ids[end:]
        self._read = len(context)
        self._prefix_len = len(context_text)
        self._held = held

    def _compact(self, ids: list[int]) -> str | None:
        """Advance to the last character boundary among the last few tokens. Returns text up to
        it not passed on yet (byte-fallback decoders turn a whole run of byte tokens into U+FFFD
        while it ends incomplete, hiding complete characters), or None if there is no boundary."""
        emitted = self._prefix_len + self._held
        for end in range(len(ids) - 1, max(self._read, len(ids) - _COMPACT_TRIES - 1), -1):
            text = self._decode(ids[:end])
            if not text.endswith(_FFFD):
                extra = text[emitted:]
                self._advance(ids, end, max(emitted - len(text), 0))
                return extra
        return None

    def _reset_window(self) -> None:
        self._ids, self._read, self._prefix_len, self._held = [], 0, 0, 0

    def _tokens_to_reach(self, ids: list[int], base: int, count: int, need: int) -> int:
        """Fewest of the `count` tokens after ids[:base] whose safe decoded text reaches `need`
        characters (safe text only grows as tokens are appended, so bisect)."""
        low, high = 1, count
        while low < high:
            mid = (low + high) // 2
            if len(self._decode(ids[:base + mid]).rstrip(_FFFD)) >= need:
                high = mid
            else:
                low = mid + 1
        return low

    # -- stop-string stage ---------------------------------------------------------------------

    def _filter(self, delta: str, final: bool) -> tuple[str, int | None]:
        """Pass `delta` through the stop strings. Returns the text to emit and, if a stop string
        matched, the stream position (in decoded characters) where it ended."""
        pending = self._pending + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop): first to complete wins
        for stop in self._stops:
            start = pending.find(stop)
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            end, start, stop = best
            self._stopped, self._matched_stop, self._pending = True, stop, ""
            return pending[:start], self._stream_len - len(pending) + end
        keep = 0 if final else self._partial_stop_len(pending)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._stop_prefix_chars:
            return 0
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
