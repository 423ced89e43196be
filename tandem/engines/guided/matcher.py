"""Guided decoding inside an engine: constraints compiled once against the model's vocabulary
(`Grammars`, an LRU cache keyed by the constraint), one `Guide` per request that follows the
tokens the request emits, and one token bitmask per step for the whole batch.

A guide moves only when its request emits a token (the batching engine's `_emit`): a preempted
request that recomputes its KV, a prefix-cache hit or a KV handoff never moves it, so it never
takes a token twice. Tokens a request brings along are taken once, when the guide is made: a
migrated request's already-generated output at the end of its prompt
(GuidedDecoding.num_output_tokens_in_prompt); a disaggregated request's first token is emitted
(and so taken) by the decode worker before it samples.

Thread safety: `Grammars` and `Guide.accept` belong to the engine's event loop; `fill_bitmask`
only reads guides, so a step's worker thread may call it while the loop waits for the step.
"""
from __future__ import annotations

import logging
import pathlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tandem.engines.guided.grammar import GrammarError, to_grammar
from tandem.engines.types import GuidedDecoding
from tandem.errors import FailedPrecondition, InvalidRequest

log = logging.getLogger(__name__)

#: Compiled grammars kept per engine, least recently used dropped first.
GRAMMAR_CACHE_SIZE = 256
_PARAM = "sampling.guided_decoding"


class Guide:
    """One request's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advances over one emitted token; False (and unmoved) when the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may follow."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into `bitmask[row]` (CPU, int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles constraints against one model's vocabulary and makes guides from them."""

    def __init__(self, tokenizer_info: Any, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size: int = tokenizer_info.vocab_size
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
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stops)
        log.info("guided decoding ready", extra={"vocab_size": vocab_size,
                                                 "vocab_type": info.vocab_type.name})
        return cls(info)

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
        guide = Guide(self._xgr.GrammarMatcher(self.compile(guided)))
        for i, token in enumerate(prompt_ids[len(prompt_ids) - num:]):
            if not guide.accept(token):
                raise InvalidRequest(
                    f"already-generated token {token} (output position {i}) breaks the "
                    f"{guided.kind.value} constraint",
                    param=f"{_PARAM}.num_output_tokens_in_prompt")
        return guide


def fill_bitmask(guides: Sequence[Guide | None], vocab_size: int) -> torch.Tensor | None:
    """One CPU int32 bitmask for a batch: row i allows what guides[i] allows next, every token
    where guides[i] is None. None when no row is guided."""
    if not any(g is not None for g in guides):
        return None
    import xgrammar

    global _batch_matcher
    bitmask = xgrammar.allocate_token_bitmask(len(guides), vocab_size)
    rows = [row for row, guide in enumerate(guides) if guide is not None]
    if len(rows) == 1:
        guides[rows[0]].fill(bitmask, rows[0])  # type: ignore[union-attr]
        return bitmask
    # Several rows: one call into xgrammar, which fills them on its own threads (GIL released).
    if _batch_matcher is None:
        _batch_matcher = xgrammar.BatchGrammarMatcher()
    _batch_matcher.batch_fill_next_token_bitmask(
        [guides[row].matcher for row in rows], bitmask, rows)  # type: ignore[union-attr]
    return bitmask


#: xgrammar's batch filler (its thread pool), made on first use.
_batch_matcher: Any = None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of forbidden tokens to -inf, in place, on the logits' device.

    On CUDA the bitmask goes up through pinned memory without blocking the host, so the step
    gains no host synchronisation."""
    import xgrammar

    if logits.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids a filled bitmask row allows, ascending."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()
