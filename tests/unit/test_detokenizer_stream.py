"""IncrementalDetokenizer on `tokenizers`' DecodeStream, against one-shot decodes and the Python
window, for each tokenizer family: byte-level BPE (GPT-2, Llama 3, Qwen), SentencePiece with byte
fallback (Llama 2, Mistral; Gemma without the leading-space strip), a Metaspace decoder, and
WordPiece. The tokenizers are trained here on the demo corpus (no downloads), with <s>, </s> and
<unk> special and <think> an added non-special token."""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from importlib import resources
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from tandem.frontend import detokenizer
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.demo import ensure_demo_model

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "café au lait, crème brûlée, naïve façade, São Paulo, Kraków, Zürich",
    "你好，世界！我住在北京。東京タワー、こんにちは、ありがとう。안녕하세요",
    "emoji 😀🎉 👍🏽 👨‍👩‍👧 🇯🇵 ❤️ 🦊🦆 mixed with text",
    "symbols ½ ≤ ≥ ≈ ∞ € £ ¥ → ✓ ★ ☃ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "  spaces   and\ttabs\n\nnew lines . , ; : ! ? it's isn't",
]
FFFD = "\ufffd"


def _corpus() -> list[str]:
    text = resources.files("tandem.model").joinpath("demo_corpus.txt").read_text("utf-8")
    return text.splitlines(keepends=True)


def _wrap(rust: RustTokenizer) -> Tokenizer:
    rust.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>",
                                             eos_token="</s>", unk_token="<unk>"))


def _train(model: Any, pre_tokenizer: Any, trainer: Any, corpus: list[str]) -> RustTokenizer:
    rust = RustTokenizer(model)
    rust.pre_tokenizer = pre_tokenizer
    rust.train_from_iterator(corpus, trainer=trainer)
    return rust


def _bpe_trainer(**kwargs: Any) -> trainers.BpeTrainer:
    return trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                               show_progress=False, **kwargs)


def _gpt2() -> Tokenizer:
    rust = _train(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=True),
                  _bpe_trainer(initial_alphabet=pre_tokenizers.ByteLevel.alphabet()), _corpus())
    rust.decoder = decoders.ByteLevel()
    return _wrap(rust)


def _sentencepiece(strip: bool) -> Tokenizer:
    """Byte fallback for what the 60-character alphabet misses (CJK, emoji, most symbols)."""
    rust = _train(models.BPE(unk_token="<unk>"),
                  pre_tokenizers.Metaspace(prepend_scheme="first" if strip else "never"),
                  _bpe_trainer(limit_alphabet=60), _corpus())
    spec = json.loads(rust.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    rust = RustTokenizer.from_str(json.dumps(spec))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    rust.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip else []))
    return _wrap(rust)


def _metaspace() -> Tokenizer:
    rust = _train(models.BPE(unk_token="<unk>"), pre_tokenizers.Metaspace(prepend_scheme="always"),
                  _bpe_trainer(), _corpus() + TEXTS)
    rust.decoder = decoders.Metaspace(prepend_scheme="always")
    return _wrap(rust)


def _wordpiece() -> Tokenizer:
    trainer = trainers.WordPieceTrainer(vocab_size=2000, show_progress=False,
                                        special_tokens=["<unk>", "<s>", "</s>"])
    rust = _train(models.WordPiece(unk_token="<unk>"), pre_tokenizers.BertPreTokenizer(), trainer,
                  _corpus() + TEXTS)
    rust.normalizer = normalizers.BertNormalizer(lowercase=False)
    rust.decoder = decoders.WordPiece(cleanup=True)
    return _wrap(rust)


BUILDERS: dict[str, Callable[[], Tokenizer]] = {
    "demo-byte-level": lambda: Tokenizer.from_dir(ensure_demo_model()),
    "gpt2-byte-level": _gpt2,
    "llama2-sentencepiece": lambda: _sentencepiece(strip=True),
    "gemma-sentencepiece": lambda: _sentencepiece(strip=False),
    "metaspace": _metaspace,
    "wordpiece": _wordpiece,
}
BYTE_FALLBACK = {"llama2-sentencepiece", "gemma-sentencepiece"}
# Where a token alone decodes unlike in context (a leading space stripped or added).
CONTEXT_SENSITIVE = {"llama2-sentencepiece", "metaspace", "wordpiece"}


@pytest.fixture(scope="module", params=list(BUILDERS))
def named_tok(request: pytest.FixtureRequest) -> tuple[str, Tokenizer]:
    return request.param, BUILDERS[request.param]()


@pytest.fixture
def detours(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the chunk size of each detour from DecodeStream through the Python window."""
    sizes: list[int] = []
    detour = detokenizer._StreamDecoding._detour

    def spy(self: detokenizer._StreamDecoding, *args: Any) -> str:
        sizes.append(len(args[-1]))
        return detour(self, *args)

    monkeypatch.setattr(detokenizer._StreamDecoding, "_detour", spy)
    return sizes


def _stream(tok: Tokenizer, ids: list[int], sizes: Iterator[int] | list[int], *,
            prompt: list[int] | tuple[int, ...] = (), skip: bool = True, stream: bool = True,
            stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    """The add() outputs, then finish()'s, of a detokenizer fed `ids` in chunks of `sizes`."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stop=stop,
                                   decode_stream=stream)
    pieces, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        pieces.append(detok.add(ids[i:i + size]))
        i += size
    pieces.append(detok.finish())
    return pieces, detok


def _sizes(rng: random.Random, kind: str) -> Iterator[int]:
    while True:  # chunks of 1 (plain decoding), 3 or 8 (multi-step, speculative) or mixed
        yield {"1": 1, "3": 3, "8": 8}.get(kind) or (rng.randint(1, 8) if rng.random() < 0.8
                                             else rng.randint(17, 40))


def _expected(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> str:
    """One-shot decode continuing the prompt's last 5 tokens (dropped if they end mid-character),
    which is the contract."""
    context = prompt[-5:]
    context_text = tok.decode(context, skip)
    if context_text.endswith(FFFD):
        context, context_text = [], ""
    text = tok.decode(context + ids, skip)
    assert text.startswith(context_text)
    return text[len(context_text):]


def _sample_text(rng: random.Random, tok: Tokenizer) -> str:
    separators = ["", " ", "\n", "<think>", tok.hf.eos_token, tok.hf.bos_token + " "]
    return "".join(rng.choice(TEXTS) + rng.choice(separators) for _ in range(rng.randint(1, 3)))


def _byte_token(tok: Tokenizer, byte: int) -> int:
    byte_id = tok.backend.token_to_id(f"<0x{byte:02X}>")
    assert byte_id is not None
    return byte_id


def test_fixture_tokenizers_are_what_they_claim(named_tok: tuple[str, Tokenizer]) -> None:
    # Guards the tests below: characters really split across tokens, a token really decodes
    # differently alone than in context (leading spaces), special and added tokens are there.
    name, tok = named_tok
    ids = tok.encode(TEXTS[2] + TEXTS[3], False)
    splits_characters = any(FFFD in tok.decode([i]) for i in ids)
    assert splits_characters == (name not in ("metaspace", "wordpiece"))  # those saw TEXTS
    words = tok.encode(TEXTS[0], False)
    alone = "".join(tok.decode([i]) for i in words)
    assert (alone != tok.decode(words)) == (name in CONTEXT_SENSITIVE)
    assert tok.vocab_size >= 2000 and tok.is_special(tok.encode(tok.hf.eos_token, False)[0])


@pytest.mark.parametrize("chunks", ["1", "3", "8", "mixed"])
def test_stream_equals_one_shot_decode(named_tok: tuple[str, Tokenizer], chunks: str,
                                       detours: list[int]) -> None:
    name, tok = named_tok
    rng = random.Random(f"{name}/{chunks}")
    for _ in range(60):
        ids = tok.encode(_sample_text(rng, tok), False)
        # Prompts end anywhere, mid-character included.
        prompt = tok.encode(rng.choice(TEXTS), False)[:rng.randint(0, 12)]
        skip = rng.random() < 0.5
        pieces, detok = _stream(tok, ids, _sizes(rng, chunks), prompt=prompt, skip=skip)
        assert isinstance(detok._decoding, detokenizer._StreamDecoding)
        assert not any(FFFD in piece for piece in pieces), pieces
        assert "".join(pieces) == detok.text == _expected(tok, prompt, ids, skip)
        assert detok.num_tokens == len(ids)
        python, _ = _stream(tok, ids, _sizes(rng, chunks), prompt=prompt, skip=skip, stream=False)
        assert "".join(python) == detok.text
    if chunks == "1":  # valid text one token at a time never needs the Python window
        assert not detours


def test_random_ids_like_an_untrained_model(named_tok: tuple[str, Tokenizer]) -> None:
    name, tok = named_tok
    rng = random.Random(name)
    byte_fallback = name in BYTE_FALLBACK
    chunk_sizes = _sizes(rng, "mixed")
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 120))]
        if byte_fallback and rng.random() < 0.5:  # runs of byte tokens with stray bytes
            ids = [_byte_token(tok, rng.randrange(256)) if rng.random() < 0.7 else i
                   for i in ids]
        skip = rng.random() < 0.5
        sizes = [next(chunk_sizes) for _ in ids]
        pieces, detok = _stream(tok, ids, sizes, skip=skip)
        python, _ = _stream(tok, ids, sizes, skip=skip, stream=False)
        assert "".join(pieces) == "".join(python)
        if not byte_fallback:  # which groups the U+FFFD of stray bytes its own way
            assert detok.text == tok.decode(ids, skip)


@pytest.mark.parametrize("chunks", ["1", "3", "8", "mixed"])
def test_stop_strings(named_tok: tuple[str, Tokenizer], chunks: str) -> None:
    name, tok = named_tok
    rng = random.Random(f"{name}/{chunks}")
    for _ in range(80):
        ids = tok.encode(rng.choice(TEXTS) + " " + rng.choice(TEXTS), False)
        text = tok.decode(ids)
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 6)]
        pieces, detok = _stream(tok, ids, _sizes(rng, chunks), stop=("never matches", stop))
        assert "".join(pieces) == detok.text == text[:text.index(stop)], (text, stop)
        assert detok.stopped and detok.matched_stop == stop
        assert detok.num_tokens == next(n for n in range(1, len(ids) + 1)
                                        if stop in tok.decode(ids[:n]))


def test_special_tokens_skipped_or_kept(named_tok: tuple[str, Tokenizer]) -> None:
    name, tok = named_tok
    ids = tok.encode(f"Hello there{tok.hf.eos_token} and{tok.hf.bos_token}你好<think> ok", False)
    specials = [i for i in ids if tok.is_special(i)]
    assert len(specials) == 2
    for skip in (True, False):
        for size in (1, 2, 3, 8):
            pieces, _ = _stream(tok, ids, [size] * len(ids), skip=skip)
            assert "".join(pieces) == tok.decode(ids, skip)


def test_many_tokens_without_text_keep_the_next_leading_space(
        named_tok: tuple[str, Tokenizer], detours: list[int]) -> None:
    # 40 skipped special tokens hold DecodeStream for long enough to go through the window,
    # which must keep the text before them as context (SentencePiece, WordPiece).
    name, tok = named_tok
    eos = tok.encode(tok.hf.eos_token, False)
    ids = tok.encode("the cat sat", False) + eos * 40 + tok.encode("the cat sat", False)[1:]
    for size in (1, 3):
        pieces, _ = _stream(tok, ids, [size] * len(ids))
        assert "".join(pieces) == tok.decode(ids)
    assert detours


def test_long_chunk_ending_mid_character_emits_what_is_complete(detours: list[int]) -> None:
    tok = BUILDERS["demo-byte-level"]()
    ids = tok.encode("Hello there, this is a long chunk of text before the giraffes 🦒🦒", False)
    cut = next(n for n in range(len(ids) - 1, 0, -1) if tok.decode(ids[:n]).endswith(FFFD))
    assert cut > 16
    detok = IncrementalDetokenizer(tok)
    # DecodeStream alone would hold it all; the window passes on what is complete.
    assert detok.add(ids[:cut]) == tok.decode(ids[:cut]).rstrip(FFFD)
    assert detours
    assert detok.text + detok.add(ids[cut:]) + detok.finish() == tok.decode(ids)
    assert isinstance(detok._decoding, detokenizer._StreamDecoding)
    assert detok._decoding._window is None  # back on DecodeStream once the character completed


def test_stray_byte_in_a_byte_fallback_run() -> None:
    tok = BUILDERS["llama2-sentencepiece"]()
    ids = [_byte_token(tok, b) for b in "你".encode() + b"\xff"] + tok.encode(" the end", False)
    # The stray byte turns the whole run into U+FFFD, also "你" DecodeStream already emitted.
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match=detokenizer._INVALID_PREFIX):
        for i in ids:
            stream.step(tok.backend, i)
    for size in (1, 2, 8):
        pieces, _ = _stream(tok, ids, [size] * len(ids))
        python, _ = _stream(tok, ids, [size] * len(ids), stream=False)
        assert pieces == python and "".join(pieces).endswith(" the end")


def test_endless_stray_bytes_are_flushed_before_finish() -> None:
    tok = BUILDERS["demo-byte-level"]()
    lead = tok.encode("🦒", False)[0]  # a lone lead byte: U+FFFD, never completed by the next
    assert tok.decode([lead]) == FFFD
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([lead]) for _ in range(200))
    assert streamed.count(FFFD) > 100
    assert streamed + detok.finish() == tok.decode([lead] * 200)


def test_backend_without_decode_stream_uses_the_python_window() -> None:
    tok = BUILDERS["demo-byte-level"]()
    backend = SimpleNamespace(decode=tok.backend.decode)  # e.g. a test double
    detok = IncrementalDetokenizer(SimpleNamespace(backend=backend))  # type: ignore[arg-type]
    assert isinstance(detok._decoding, detokenizer._WindowDecoding)
    ids = tok.encode(TEXTS[3], False)
    assert "".join(detok.add([i]) for i in ids) + detok.finish() == TEXTS[3]
