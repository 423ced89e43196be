"""Guided decoding inside an engine: constraints compiled once against the model's vocabulary
(`Grammars`, an LRU cache keyed by the constraint), one `Guide` per request that follows the
tokens the request emits, and one token bitmask per step for the whole batch.

A guide moves only when its request emits a token (the batching engine's `_emit`): a preempted
request that recomputes its KV, a prefix-cache hit or a KV handoff never moves it, so it never
takes a token twice. Tokens a request brings along are taken once, when the guide is made: a
migrated request's already-generated output at the end of its prompt
(GuidedDecoding.num_output_tokens_in_prompt); a disaggregated request's first token is emitted
(and so taken) by the decode worker before it samples.

Thread safety: `Grammars`, `Guide.accept` and `Guide.defer` belong to the engine's event loop;
`fill_bitmask` moves only the guides of the step it fills (over their deferred tokens), so a
step's worker thread may call it while the loop waits for the step: the loop emits, and so
defers, a request's tokens only between steps.

xgrammar's vocabulary is the tokenizer's, not the model's: a model whose logits are wider than
its tokenizer (padded to a multiple of 64 or 128, or a small tokenizer on a large head) has ids
no text maps to, which xgrammar would treat as special tokens, and xgrammar pays for each
special token in every mask fill and every accept (a linear scan; ~50 us per accept and ~200 us
per fill for 124k padding ids, issue 25). Those ids are never allowed: `fill_bitmask` writes
their bits 0 itself, so the mask is the same bit for bit.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tandem.engines.guided.grammar import GrammarError, to_grammar
from tandem.engines.types import GuidedDecoding
from tandem.errors import FailedPrecondition, InvalidRequest
from tandem.runtime.cores import usable_cores

log = logging.getLogger(__name__)


class _LazyTorch:
    """torch, imported at the first use of one of its names: the batching engine imports this
    module, and a mock engine's worker, which needs torch only for a guided request's masks,
    then starts in 0.3 s instead of 1.5 s of CPU (the planner adds workers under a burst, many
    at once). The first use puts the module itself in its place, so that the masks' per-step
    code reads torch's names directly from then on."""

    def __getattr__(self, name: str) -> Any:
        import torch as module
        globals()["torch"] = module
        return getattr(module, name)


if TYPE_CHECKING:
    import torch
else:
    torch = _LazyTorch()

#: Compiled grammars kept per engine, least recently used dropped first.
GRAMMAR_CACHE_SIZE = 256
_PARAM = "sampling.guided_decoding"
#: Threads of xgrammar's batch mask fill; 0 (the default): half the cores this process may use.
FILL_THREADS_ENV = "TANDEM_GUIDED_FILL_THREADS"
#: Chunks of a batch's accepts and mask fill run in parallel (see fill_chunks).
FILL_CHUNKS_ENV = "TANDEM_GUIDED_FILL_CHUNKS"
_CHUNK_THREAD = "tandem-grammar"


def bitmask_words(vocab_size: int) -> int:
    """32-bit words of one bitmask row over `vocab_size` tokens."""
    return -(-vocab_size // 32)


def grammar_vocab_size(tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> int:
    """The vocabulary xgrammar matches against: every id the tokenizer maps to text, and the stop
    ids, rounded up to whole 32-bit words of the bitmask; at most the model's `vocab_size`."""
    ids = tokenizer.get_vocab().values()
    extent = max(len(tokenizer), max(ids, default=-1) + 1, max(stop_ids, default=-1) + 1)
    return min(vocab_size, 32 * bitmask_words(extent))


class Guide:
    """One request's position in its grammar.

    A sampled token may be taken later (`defer`): the engine masked what it sampled, so the
    grammar allows it, and whether it ends the grammar is known now (a stop token, allowed only
    once the grammar is complete). `fill_bitmask` takes the deferred tokens first, in the step's
    worker thread while the device computes, rather than on the event loop between steps."""

    __slots__ = ("matcher", "words", "stop_ids", "pending", "stopped", "rejected")

    def __init__(self, matcher: Any, words: int | None = None) -> None:
        self.matcher = matcher
        #: Bitmask words xgrammar fills (its vocabulary's); None: the bitmask's whole width.
        #: Bits past them (ids outside the tokenizer) are never allowed.
        self.words = words
        self.stop_ids = frozenset(matcher.stop_token_ids)
        #: Tokens deferred, not yet taken by the matcher.
        self.pending: list[int] = []
        #: A deferred stop token ended the grammar.
        self.stopped = False
        #: A deferred token the grammar refused (a bug in whatever sampled it), else None.
        self.rejected: int | None = None

    def accept(self, token_id: int) -> bool:
        """Advances over one emitted token; False (and unmoved) when the grammar forbids it."""
        self.flush()
        return self.rejected is None and bool(self.matcher.accept_token(token_id))

    def defer(self, token_id: int) -> bool:
        """Takes a token sampled under this guide's mask, later (`flush`); False when a token
        deferred earlier turned out forbidden."""
        if self.rejected is not None:
            return False
        self.pending.append(token_id)
        if token_id in self.stop_ids:
            self.stopped = True
        return True

    def flush(self) -> None:
        """Advances over the deferred tokens."""
        pending = self.pending
        if not pending:
            return
        for token in pending:
            if self.rejected is None and not self.matcher.accept_token(token):
                self.rejected = token
        pending.clear()

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may follow."""
        return self.stopped or bool(self.matcher.is_terminated())

    def masks_along(self, drafts: list[int], width: int) -> tuple[list[int], torch.Tensor]:
        """The masks of a verify pass over proposed tokens (speculative decoding): row j
        allows what may follow the proposals' first j tokens (every token once the grammar
        ended, as `fill_bitmask` does). The proposals are cut before the first the grammar
        forbids, and after one that ends it. Returns (the proposals kept, their len + 1 rows
        [rows, width] int32); the guide is left where it was (rolled back over them)."""
        self.flush()
        masks = torch.empty((len(drafts) + 1, width), dtype=torch.int32)
        matcher = self.matcher
        taken = 0
        while True:
            ended = self.rejected is not None or bool(matcher.is_terminated())
            if ended:
                masks[taken] = -1
            else:
                self.fill(masks, taken)
            if ended or taken == len(drafts) or not matcher.accept_token(drafts[taken]):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)
        return drafts[:taken], masks[:taken + 1]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into `bitmask[row]` (CPU, int32)."""
        self.flush()
        words = self.words
        if words is None or words == bitmask.shape[-1]:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return
        part = torch.empty(words, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(part, 0)
        bitmask[row, :words] = part
        bitmask[row, words:] = 0


class Grammars:
    """Compiles constraints against one model's vocabulary and makes guides from them."""

    def __init__(self, tokenizer_info: Any, cache_size: int = GRAMMAR_CACHE_SIZE,
                 vocab_size: int | None = None) -> None:
        import xgrammar

        self._xgr = xgrammar
        #: The model's vocabulary (the logits' width); xgrammar's may be narrower.
        self.vocab_size: int = vocab_size or tokenizer_info.vocab_size
        #: Bitmask words xgrammar fills per row; None when that is the whole row.
        self._words = (bitmask_words(tokenizer_info.vocab_size)
                       if bitmask_words(tokenizer_info.vocab_size)
                       != bitmask_words(self.vocab_size) else None)
        #: Each token's text as bytes (b"" for special tokens).
        self.decoded_vocab: list[bytes] = tokenizer_info.decoded_vocab
        # Its own cache is off: ours is bounded by count and keyed by the constraint.
        self._compiler = xgrammar.GrammarCompiler(tokenizer_info, max_threads=1,
                                                  cache_enabled=False)
        self._cache: OrderedDict[Any, Any] = OrderedDict()
        self._cache_size = cache_size
        #: Lookups answered from the cache, and compilations (observability, tests).
        self.num_hits = 0
        self.num_compiled = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path, vocab_size: int,
                       eos_ids: Iterable[int]) -> Grammars:
        """From the Hugging Face tokenizer in `model_dir` (read offline). `vocab_size` is the
        model's (the logits' width), which may exceed the tokenizer's; `eos_ids` are the tokens
        that end a completed grammar.

        Raises:
            FailedPrecondition: the directory has no loadable tokenizer.
        """
        import xgrammar
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"guided decoding needs the model's tokenizer, which "
                                     f"{model_dir} does not hold: {exc}", param=_PARAM) from exc
        stops = sorted(set(eos_ids)) or None
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=grammar_vocab_size(tokenizer, vocab_size, stops or ()),
            stop_token_ids=stops)
        log.info("guided decoding ready", extra={"vocab_size": vocab_size,
                                                 "grammar_vocab_size": info.vocab_size,
                                                 "vocab_type": info.vocab_type.name})
        return cls(info, vocab_size=vocab_size)

    def compile(self, guided: GuidedDecoding) -> Any:
        """The compiled grammar of a constraint, from the cache when it was seen lately.

        Raises:
            InvalidRequest: the constraint is not a valid schema, pattern or grammar.
        """
        key = guided.grammar_key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.num_hits += 1
            return compiled
        try:
            compiled = self._compiler.compile_grammar(to_grammar(guided))
        except GrammarError as exc:
            raise InvalidRequest(f"invalid {guided.kind.value} constraint: {exc}",
                                 param=f"{_PARAM}.{guided.kind.value}") from None
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def guide(self, guided: GuidedDecoding, prompt_ids: Sequence[int]) -> Guide:
        """A new request's guide, advanced over the output its prompt already ends with.

        Raises:
            InvalidRequest: a bad constraint, or already-generated tokens it does not allow.
        """
        num = guided.num_output_tokens_in_prompt
        if num > len(prompt_ids):
            raise InvalidRequest(f"num_output_tokens_in_prompt ({num}) exceeds the prompt's "
                                 f"{len(prompt_ids)} tokens",
                                 param=f"{_PARAM}.num_output_tokens_in_prompt")
        guide = Guide(self._xgr.GrammarMatcher(self.compile(guided)), self._words)
        for i, token in enumerate(prompt_ids[len(prompt_ids) - num:]):
            if not guide.accept(token):
                raise InvalidRequest(
                    f"already-generated token {token} (output position {i}) breaks the "
                    f"{guided.kind.value} constraint",
                    param=f"{_PARAM}.num_output_tokens_in_prompt")
        return guide


def fill_bitmask(guides: Sequence[Guide | torch.Tensor | None], vocab_size: int,
                 out: torch.Tensor | None = None) -> torch.Tensor | None:
    """One CPU int32 bitmask for a batch: row i allows what guides[i] allows next, every token
    where guides[i] is None, and is guides[i] where that is a row already filled (a verify
    pass's rows: `Guide.masks_along`). None when no row is guided. The guides first take the tokens
    deferred to them (`Guide.defer`); a row whose grammar then ended (complete, or refused a
    deferred token) allows every token: its request finishes with that token. `out`: a
    buffer to fill (at least len(guides) rows of the bitmask's width, pinned memory for a
    copy to the GPU that does not wait); the bitmask is then its first rows."""
    rows = [row for row, guide in enumerate(guides) if guide is not None]
    if not rows:
        return None
    width = bitmask_words(vocab_size)
    if out is None:
        bitmask = torch.empty((len(guides), width), dtype=torch.int32)
    else:
        bitmask = out[:len(guides)]
    if len(rows) < len(guides):
        bitmask.fill_(-1)
    filled = [row for row in rows if isinstance(guides[row], torch.Tensor)]
    for row in filled:
        bitmask[row] = guides[row]  # type: ignore[assignment]
    if filled:
        rows = [row for row in rows if not isinstance(guides[row], torch.Tensor)]
        if not rows:
            return bitmask
    chunks = fill_chunks()
    if chunks > 1 and len(rows) >= 2 * chunks:
        per = -(-len(rows) // chunks)
        parts = [rows[i:i + per] for i in range(0, len(rows), per)]
        inference = torch.is_inference_mode_enabled()  # the chunks' threads write as we do

        def chunk(part: list[int]) -> None:
            with torch.inference_mode(inference):
                _flush_and_fill(guides, part, bitmask)

        list(_chunk_pool(chunks).map(chunk, parts))
    else:
        _flush_and_fill(guides, rows, bitmask)
    return bitmask


def _flush_and_fill(guides: Sequence[Guide | torch.Tensor | None], rows: list[int],
                    bitmask: torch.Tensor) -> None:
    """The guides of `rows` take their deferred tokens, then fill their rows of `bitmask`."""
    flush_guides([guides[row] for row in rows])  # type: ignore[misc]
    ended = [row for row in rows
             if guides[row].rejected is not None or guides[row].is_terminated]  # type: ignore[union-attr]
    if ended:
        bitmask[ended] = -1
        done = set(ended)
        rows = [row for row in rows if row not in done]
    width = bitmask.shape[-1]
    by_words: dict[int, list[int]] = {}
    for row in rows:
        by_words.setdefault(guides[row].words or width, []).append(row)  # type: ignore[union-attr]
    for words, group in by_words.items():
        if words == width:
            _fill_rows(guides, group, bitmask)
            continue
        # xgrammar fills its narrower rows; the ids past its vocabulary are never allowed.
        part = torch.empty((len(guides), words), dtype=torch.int32)
        _fill_rows(guides, group, part)
        if len(group) == len(guides):
            bitmask[:, :words] = part
            bitmask[:, words:] = 0
        else:
            index = torch.tensor(group)
            bitmask[index, :words] = part[index]
            bitmask[index, words:] = 0


def flush_guides(guides: list[Guide]) -> None:
    """Advances each guide over its deferred tokens: one call into xgrammar for those with one."""
    ones = [g for g in guides if len(g.pending) == 1 and g.rejected is None]
    if len(ones) > 1:
        import xgrammar

        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token(
            [g.matcher for g in ones], [g.pending[0] for g in ones])
        for guide, ok in zip(ones, accepted, strict=True):
            if not ok:
                guide.rejected = guide.pending[0]
            guide.pending.clear()
    for guide in guides:
        guide.flush()


def _fill_rows(guides: Sequence[Guide | torch.Tensor | None], rows: list[int],
               bitmask: torch.Tensor) -> None:
    """Fills `bitmask[row]` from guides[row] for each row (as wide as those guides' masks);
    several rows in one call into xgrammar (GIL released): on its thread pool, or on one
    thread inside a chunk of a parallel fill (`fill_chunks`)."""
    if len(rows) == 1:
        guides[rows[0]].matcher.fill_next_token_bitmask(bitmask, rows[0])  # type: ignore[union-attr]
        return
    _batch_matcher().batch_fill_next_token_bitmask(
        [guides[row].matcher for row in rows], bitmask, rows)  # type: ignore[union-attr]


def fill_threads() -> int:
    """Threads for xgrammar's batch fill: TANDEM_GUIDED_FILL_THREADS, else half the cores this
    process may run on (xgrammar's own default halves the host's, which a container may not
    have)."""
    configured = int(os.environ.get(FILL_THREADS_ENV, "0") or 0)
    return configured if configured > 0 else max(1, usable_cores() // 2)


def fill_chunks() -> int:
    """Chunks a batch's accepts and fills split into, each on a thread of its own with
    one-thread xgrammar calls: TANDEM_GUIDED_FILL_CHUNKS, else one per 4 cores this process
    may run on, at most 4. One chunk: xgrammar's serial batch accept, then its pooled batch
    fill. On the H100 host's 16 cores, 64 rows per step: 4 chunks cost the steps' thread
    5.6 ms against 7.8 ms for one and 5.3 ms for 8 (benchmarks/guided_decoding.py --phases,
    issue 25)."""
    configured = int(os.environ.get(FILL_CHUNKS_ENV, "0") or 0)
    return configured if configured > 0 else max(1, min(4, usable_cores() // 4))


_local = threading.local()
_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _batch_matcher() -> Any:
    """xgrammar's batch filler for this thread: its thread pool on the thread that fills a
    whole batch, one thread inside a chunk's thread."""
    matcher = getattr(_local, "batch_matcher", None)
    if matcher is None:
        import xgrammar

        chunked = threading.current_thread().name.startswith(_CHUNK_THREAD)
        matcher = _local.batch_matcher = xgrammar.BatchGrammarMatcher(
            1 if chunked else fill_threads())
    return matcher


def _chunk_pool(chunks: int) -> concurrent.futures.ThreadPoolExecutor:
    pool = _pools.get(chunks)
    if pool is None:
        pool = _pools[chunks] = concurrent.futures.ThreadPoolExecutor(
            max_workers=chunks, thread_name_prefix=_CHUNK_THREAD)
    return pool


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of forbidden tokens to -inf, in place, on the logits' device.

    A CPU bitmask for CUDA logits goes up through pinned memory without blocking the host, so
    the step gains no host synchronisation."""
    import xgrammar

    if bitmask.device != logits.device:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids a filled bitmask row allows, ascending."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()
