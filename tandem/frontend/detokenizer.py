"""Incremental detokenization of one request's output, with stop strings.

Two stages, each holding back text that is not final yet:

1. Decoding. Tokens do not map to characters: a CJK character or an emoji can span several
   byte-level tokens, and SentencePiece decoders drop the leading space of the first token they
   see. So we decode a small window (a few final tokens for context, then the unread ones) and
   emit the part past the context, as vLLM and TGI do with prefix_offset/read_offset. While the
   window's text ends in U+FFFD (an incomplete UTF-8 sequence) the unread tokens wait for a later
   chunk to complete the character. `tokenizers`' own DecodeStream does this in Rust
   (_StreamDecoding), for every tokenizer family; a window in Python (_WindowDecoding) takes
   chunks of more than 4 tokens (it decodes fewer tokens per chunk), the tokens DecodeStream
   would hold for long (a long chunk ending mid-character, stray bytes, tokens without text) or
   fails on (a stray byte in a byte-fallback run), and backends other than `tokenizers.Tokenizer`.
2. Stop strings. The text is searched for the stop strings; the longest suffix that could still
   grow into one is held back until the next chunk decides it.

Each add() costs two decodes of a few tokens, never of the whole output: DecodeStream decodes
the previous chunk and this one, then this one; the window 5 tokens and this chunk, then 5.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

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
# Longest chunk decoded with DecodeStream. It decodes the chunk twice and the previous one again,
# the Python window the chunk and 5 tokens twice: past a few tokens the window costs less
# (benchmarks/probes/detokenize.py: DecodeStream 1.6x faster per token in chunks of 1, 1.2x in chunks of
# 4 on English, slower from 8 on).
_STREAM_MAX_CHUNK = 4
# How DecodeStream.step reports a window whose text no longer starts with the text it emitted.
_INVALID_PREFIX = "Invalid prefix"

Decode = Callable[[list[int]], str]


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

    `decode_stream=False` keeps decoding in Python throughout (tests and benchmarks compare the
    two); by default it runs in `tokenizers`' DecodeStream where the backend allows.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 decode_stream: bool = True) -> None:
        backend = tokenizer.backend
        backend_decode = backend.decode

        def decode(ids: list[int]) -> str:
            text: str = backend_decode(ids, skip_special_tokens)
            return text

        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        # The stops' proper prefixes as (length, stop), longest first, by their last character:
        # a held-back suffix is one of those ending in the text's last character.
        self._stop_prefixes: dict[str, list[tuple[int, str]]] = {}
        for size, whole in sorted(((n, s) for s in self._stops for n in range(1, len(s))),
                                  reverse=True):
            self._stop_prefixes.setdefault(whole[size - 1], []).append((size, whole))
        context = list(prompt_ids[-_CONTEXT_TOKENS:]) if len(prompt_ids) else []
        context_text = decode(context) if context else ""
        if context_text.endswith(_FFFD):  # the prompt ends mid-character: do not glue onto it
            context, context_text = [], ""
        self._decoding: _Decoding
        if decode_stream and isinstance(backend, tokenizers.Tokenizer):
            self._decoding = _StreamDecoding(backend, skip_special_tokens, decode, context)
        else:
            self._decoding = _WindowDecoding(decode, context, len(context), len(context_text))
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
        stream = self._stream_len
        delta = self._decoding.add(token_ids)
        self._stream_len += len(delta)
        num_before = self._num_tokens
        self._num_tokens += len(token_ids)
        if not self._stops:
            if delta:
                self._parts.append(delta)
            return delta
        out, stop_end = self._filter(delta, final=False)
        if stop_end is not None:
            self._num_tokens = num_before + self._decoding.tokens_to_reach(
                len(token_ids), stop_end - stream)
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
        delta = self._decoding.finish()
        self._stream_len += len(delta)
        out = self._filter(delta, final=True)[0] if self._stops else delta
        if out:
            self._parts.append(out)
        return out

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
        for size, stop in self._stop_prefixes.get(text[-1:], ()):
            if size <= len(text) and stop.startswith(text[-size:]):
                return size
        return 0


# -- decoding stage --------------------------------------------------------------------------------

class _Decoding(Protocol):
    """The decoding stage: token ids in, text that is safe to emit out."""

    def add(self, token_ids: Sequence[int]) -> str:
        """Text the chunk completes: never ends inside an incomplete UTF-8 sequence."""

    def finish(self) -> str:
        """Everything held back; a partial character becomes U+FFFD."""

    def tokens_to_reach(self, count: int, need: int) -> int:
        """How many of the last add()'s `count` tokens it takes for the text to reach `need`
        characters of what that add() returned: 0 or less where tokens of earlier add() calls,
        held back, did (DecodeStream holds the text before an incomplete character)."""


class _StreamDecoding:
    """Decoding in Rust by `tokenizers.decoders.DecodeStream`. Its window is the tokens of the
    last chunk that produced text (the context) and the unread ones after them; a step decodes
    it, and the new context once text comes out.

    DecodeStream holds all the text of a window ending in U+FFFD, even that before the incomplete
    character, and raises when the window's text stops starting with the context's (a stray byte
    in a byte-fallback run turns the whole run into U+FFFD). So a window that holds more than
    _COMPACT_AFTER tokens or hits that error goes to _WindowDecoding, which emits up to the last
    complete character, compacts, and flushes stray bytes; so do chunks longer than
    _STREAM_MAX_CHUNK, which the window decodes faster. DecodeStream takes over again, from the
    window's context, after a short chunk leaves no token unread.
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool, decode: Decode,
                 context: list[int]) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._decode = decode
        self._start(context)
        self._before = (context, self._unread, self._unread)  # context, unread, chunk of add()
        self._window: _WindowDecoding | None = None  # decoding in Python for now
        self._window_took: _WindowDecoding | None = None  # the window, if it took the last add()

    def _start(self, context: list[int]) -> None:
        # The context must end on a character boundary: DecodeStream would emit the text of one
        # ending in U+FFFD.
        self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip)
        self._context = context
        self._unread: list[int] = []

    def add(self, token_ids: Sequence[int]) -> str:
        window = self._window_took = self._window
        if window is not None:
            delta = window.add(token_ids)
            if len(token_ids) <= _STREAM_MAX_CHUNK and window.is_caught_up:
                self._window = None
                self._start(window.context)
            return delta
        if len(token_ids) > _STREAM_MAX_CHUNK:
            return self._detour(self._context, self._unread, token_ids)
        ids = list(token_ids)
        context, unread = self._context, self._unread
        self._before = (context, unread, ids)
        try:
            text = self._stream.step(self._backend, ids[0] if len(ids) == 1 else ids)
        except Exception as exc:  # tokenizers raises a plain Exception
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            return self._detour(context, unread, ids)
        if text is not None:
            self._context, self._unread = unread + ids if unread else ids, []
            return text
        self._unread = unread + ids
        if len(self._unread) > _COMPACT_AFTER:
            return self._detour(context, unread, ids)
        return ""

    def finish(self) -> str:
        if self._window is None:
            if not self._unread:
                return ""
            self._window = _WindowDecoding.after(self._decode, self._context, self._unread)
        return self._window.finish()

    def tokens_to_reach(self, count: int, need: int) -> int:
        if self._window_took is not None:
            return self._window_took.tokens_to_reach(count, need)
        context, unread, ids = self._before
        if not unread and count == 1:
            return 1
        window = [*context, *unread, *ids]
        return _tokens_to_reach(self._decode, window, len(context), len(unread) + count,
                                len(self._decode(context)) + need) - len(unread)

    def _detour(self, context: list[int], unread: list[int], token_ids: Sequence[int]) -> str:
        """Add `token_ids` to a Python window of final `context` and `unread` ids."""
        self._window = _WindowDecoding.after(self._decode, context, unread)
        return self.add(token_ids)


class _WindowDecoding:
    """Decoding in Python: two decodes of the window per chunk, the text and the new context.
    Unlike DecodeStream, it passes on the text before an incomplete character at once, and
    compacts a window that has grown long behind one."""

    def __init__(self, decode: Decode, ids: list[int], read: int, prefix_len: int) -> None:
        self._decode = decode
        # Decode window: ids[:read] are final context, the rest are unread.
        self._ids = ids
        self._read = read
        self._prefix_len = prefix_len  # len(decode(ids[:read]))
        self._held = 0  # chars of decode(ids) past the prefix already passed on
        # The window of the last add() (extended by its chunk), its read point, where the chunk
        # starts, and the chars of the window's text passed on before it.
        self._before = (ids, read, len(ids), prefix_len)

    @classmethod
    def after(cls, decode: Decode, context: list[int], unread: list[int]) -> _WindowDecoding:
        """A window with final `context` (ending on a character boundary) and `unread` ids."""
        return cls(decode, [*context, *unread], len(context),
                   len(decode(context)) if context else 0)

    @property
    def is_caught_up(self) -> bool:
        """Whether every token is final (no text held back)."""
        return len(self._ids) == self._read

    @property
    def context(self) -> list[int]:
        """The final tokens decoded as context, ending on a character boundary."""
        return self._ids[:self._read]

    def add(self, token_ids: Sequence[int]) -> str:
        ids = self._ids  # _step replaces self._ids; this list keeps the pre-step window
        self._before = (ids, self._read, len(ids), self._prefix_len + self._held)
        ids.extend(token_ids)
        return self._step(final=False)

    def finish(self) -> str:
        return self._step(final=True)

    def tokens_to_reach(self, count: int, need: int) -> int:
        ids, read, base, consumed = self._before
        held = base - read  # unread before the chunk: taken over from DecodeStream with text
        return _tokens_to_reach(self._decode, ids, read, held + count, consumed + need) - held

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
        if not context_text and self._prefix_len and end <= _MAX_UNREAD:
            # No text in the new context (skipped special tokens): keep the old one before it,
            # or the next token decodes as a first one, which loses its leading space
            # (SentencePiece, WordPiece).
            context = ids[:end]
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


def _tokens_to_reach(decode: Decode, ids: list[int], base: int, count: int, need: int) -> int:
    """Fewest of the `count` tokens after ids[:base] whose safe decoded text reaches `need`
    characters. Safe text grows as tokens are appended, except that byte-fallback decoders turn
    a run of byte tokens into U+FFFD while its last character is incomplete (3 tokens at most):
    so bisect, then look back across such gaps."""
    def reaches(num: int) -> bool:
        return len(decode(ids[:base + num]).rstrip(_FFFD)) >= need

    low, high = 1, count
    while low < high:
        mid = (low + high) // 2
        if reaches(mid):
            high = mid
        else:
            low = mid + 1
    fewest = num = low
    while num > 1 and fewest - num < 4:
        num -= 1
        if reaches(num):
            fewest = num
    return fewest
