"""The frontend's tokenizer: text to token ids, chat messages to a prompt, ids back to text.

Wraps a Hugging Face tokenizer loaded offline from a local model directory. The transformers object
serves the rare, feature-heavy calls (chat templates); the hot paths (encode per request, decode
per streamed chunk) go straight to its Rust `tokenizers.Tokenizer`, which skips transformers'
Python layers. Decoding never applies `clean_up_tokenization_spaces`, so streamed and
non-streamed text agree.

Thread safety: encode and decode may be called from several threads; chat templates are rendered
by transformers, which caches the compiled template.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import tokenizers

from tandem.errors import InvalidRequest
from tandem.frontend.prefix_tokens import PrefixTokenCache

# What a chat template can raise on malformed messages (a missing key, a None where a string was
# expected, raise_exception(...)): all are the client's fault.
#: Texts at least this long are encoded on a worker thread (Tokenizer.encode_off_loop): ~1 ms of
#: encoding and up, where the thread hop (~0.05 ms) is small beside what the loop gets back.
OFF_LOOP_CHARS = 4096
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError,
                    IndexError)


class Tokenizer:
    """One model's tokenizer. Build with `from_dir`; the constructor takes a loaded
    transformers fast tokenizer (tests use it with hand-made tokenizers)."""

    def __init__(self, hf_tokenizer: Any, *, eos_token_ids: Iterable[int] = (),
                 name: str = "") -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise InvalidRequest(f"model {name or '?'} has no fast tokenizer (tokenizer.json)",
                                 param="model")
        self._hf = hf_tokenizer
        #: The Rust tokenizer behind the transformers object; hot paths call it directly.
        self.backend: tokenizers.Tokenizer = hf_tokenizer.backend_tokenizer
        #: tokenizers >= 0.21's offsets-free batch encoder (see encode); None before it.
        self._encode_fast = getattr(self.backend, "encode_batch_fast", None)
        self.name = name
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in ids:
            ids.insert(0, hf_tokenizer.eos_token_id)
        self._eos_token_ids = tuple(ids)
        self._vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        bos = hf_tokenizer.bos_token_id
        self._bos_token_id = bos if isinstance(bos, int) else None
        specials = {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()
                    if t.special}
        self._special_ids = frozenset(specials)
        self._special_texts = frozenset(specials.values())
        self._prefix_cache = PrefixTokenCache(self.backend)
        #: What add_special_tokens puts around a text's ids (e.g. a BOS before), when that is
        #: all it does; None when the post-processor does more (no cached prefixes then).
        self._special_wrap = self._probe_special_wrap()

    def _probe_special_wrap(self) -> tuple[list[int], list[int]] | None:
        wraps = set()
        for probe in ("Hello world", "a b c 123 xyz"):
            plain = self.encode(probe, False)
            full = self.encode(probe, True)
            starts = [i for i in range(len(full) - len(plain) + 1)
                      if full[i:i + len(plain)] == plain]
            if not plain or not starts:
                return None
            wraps.add((tuple(full[:starts[0]]), tuple(full[starts[0] + len(plain):])))
        if len(wraps) != 1:
            return None
        head, tail = wraps.pop()
        return list(head), list(tail)

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> Tokenizer:
        """Load the tokenizer of a local model directory, never touching the network.

        End-of-sequence ids are the tokenizer's eos token plus the `eos_token_id`s of config.json
        and generation_config.json (instruct models often stop on several ids).
        Raises InvalidRequest if the directory is missing or has no fast tokenizer."""
        root = pathlib.Path(path)
        if not root.is_dir():
            raise InvalidRequest(f"model directory {root} does not exist", param="model")
        from transformers import AutoTokenizer  # slow import; only loaders need it

        try:
            hf = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"cannot load a tokenizer from {root}: {exc}",
                                 param="model") from exc
        return cls(hf, eos_token_ids=_config_eos_ids(root), name=root.name)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation; the tokenizer's own eos token first."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer knows, added tokens included. The model's embedding
        table may be larger (padded); ids beyond this size decode to nothing."""
        return self._vocab_size

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    @property
    def special_texts(self) -> frozenset[str]:
        """The text of every special token (what skip_special_tokens removes)."""
        return self._special_texts

    def template_reads(self, variable: str) -> bool:
        """Whether the chat template mentions `variable` (e.g. "tools", "reasoning_effort"): a
        template that does not would drop it without a word."""
        template = self._hf.chat_template
        sources = template.values() if isinstance(template, dict) else [template or ""]
        return any(variable in source for source in sources)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer, for the rare call this class does not wrap."""
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens the tokenizer's post-processor adds its
        markers (e.g. a leading BOS); special-token text inside `text` is parsed as special.

        Through `encode_batch_fast` where the tokenizers release has it: the same ids without
        the character offsets, which cost ~40 us of a 200-token prompt's ~100-190 us (a word
        and a byte-level BPE vocabulary, measured here), on the event loop of every request."""
        if self._encode_fast is not None:
            fast: list[int] = self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
            return fast
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    async def encode_off_loop(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode() for callers on the event loop. A long text is encoded on a worker thread
        through `encode_batch`, which releases the GIL (`encode` does not), so the loop goes on
        serving other requests while another core encodes; a short one inline, where the thread
        hop would cost more than it saves. A long text whose beginning a recent one shared
        reuses that beginning's ids (tandem.frontend.prefix_tokens) and encodes the rest."""
        if len(text) < OFF_LOOP_CHARS:
            return self.encode(text, add_special_tokens)
        if add_special_tokens and self._special_wrap is None:
            return await self._in_thread(text, True)
        cache = self._prefix_cache
        hit = cache.lookup(text)
        if hit is None:
            ids = await self._in_thread(text, False, keep=True)
        else:
            cache.num_hits += 1
            rest = text[hit.cut:]
            ids = [*hit.ids, *(self.encode(rest, False) if len(rest) < OFF_LOOP_CHARS
                               else await self._in_thread(rest, False))]
            if not hit.kept.verified and not cache.check(hit, ids,
                                                        await self._in_thread(text, False)):
                ids = await self._in_thread(text, False)
        if not add_special_tokens:
            return ids
        assert self._special_wrap is not None
        head, tail = self._special_wrap
        return [*head, *ids, *tail]

    async def _in_thread(self, text: str, add_special_tokens: bool,
                         keep: bool = False) -> list[int]:
        """`text` encoded on a worker thread; with `keep` its encoding goes to the prefix
        cache."""
        encoding = await asyncio.get_running_loop().run_in_executor(
            None, self._encode_one_in_batch, text, add_special_tokens)
        if keep:
            self._prefix_cache.keep(text, encoding.ids, encoding.offsets)
        ids: list[int] = encoding.ids
        return ids

    def _encode_one_in_batch(self, text: str, add_special_tokens: bool) -> tokenizers.Encoding:
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text the model's chat template makes of `messages`.

        `tools` (OpenAI's tool objects) and `variables` (extra template variables, e.g.
        enable_thinking) reach the template as transformers' apply_chat_template passes them.
        Raises InvalidRequest (param "messages") when the model has no chat template or the
        template rejects the messages."""
        if not self.has_chat_template:
            raise InvalidRequest(
                f"model {self.name or '?'} has no chat template; send a prompt instead of "
                "messages", param="messages")
        try:
            text = self._hf.apply_chat_template(
                list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, tokenize=False,
                **(variables or {}))
        except _TEMPLATE_ERRORS as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}",
                                 param="messages") from exc
        if not isinstance(text, str):
            raise InvalidRequest("the chat template did not render a single prompt",
                                 param="messages")
        return text

    def warm(self) -> None:
        """Compiles the chat template and runs the tokenizer both ways once, at start, so
        that the first request does not pay for them (the demo template's first render takes
        ~8 ms, the next ~0.1 ms). A template that rejects a lone user message is left cold."""
        if self.has_chat_template:
            with contextlib.suppress(InvalidRequest):
                self.render_chat([{"role": "user", "content": "Hello"}])
        self.decode(self.encode("Hello", add_special_tokens=False))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for chat `messages`, ending with the assistant's turn header.

        Rendered text is encoded without added special tokens (as transformers does): the
        template writes its own BOS. Raises InvalidRequest as render_chat does."""
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; incomplete UTF-8 at the end decodes to U+FFFD. Use
        IncrementalDetokenizer for streams."""
        text: str = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings of `token_ids` (None for an unknown id); for logprobs output."""
        id_to_token = self.backend.id_to_token
        return [id_to_token(i) for i in token_ids]

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token (skipped by skip_special_tokens)."""
        return token_id in self._special_ids

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Raise InvalidRequest if a client-supplied id is outside [0, vocab_size)."""
        limit = self._vocab_size
        for token_id in token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < limit:
                raise InvalidRequest(f"token id {token_id!r} is outside the vocabulary "
                                     f"[0, {limit})", param=param)


def _config_eos_ids(root: pathlib.Path) -> list[int]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = root / name
        if not file.is_file():
            continue
        raw = json.loads(file.read_text(encoding="utf-8"))
        for source in (raw, raw.get("text_config") or {}):
            value = source.get("eos_token_id")
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and not isinstance(item, bool) and item not in ids:
                    ids.append(item)
    return ids
