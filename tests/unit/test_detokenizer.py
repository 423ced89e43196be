"""The frontend's Tokenizer wrapper and IncrementalDetokenizer (UTF-8 hold-back, stop strings)."""
from __future__ import annotations

import json
import pathlib
import random
import shutil

import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.tokenizer import Tokenizer
from tandem.model.demo import create_demo_model

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "café au lait, crème brûlée, naïve façade, São Paulo, Kraków, Zürich, smörgåsbord",
    "你好，世界！我住在北京。東京タワー、こんにちは、ありがとう。안녕하세요",
    "emoji 😀🎉 👍🏽 👨‍👩‍👧 🇯🇵 ❤️ 🦊🦆 mixed with text",
    "symbols ½ ≤ ≥ ≈ ∞ € £ ¥ → ✓ ★ ☃ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "  spaces   and\ttabs\n\nnew lines\r\n . , ; : ! ?",
    "Q: 15% of 240? A: 36. 3.14159 2025-03-14 23:59:59",
]
CHAT_PROMPT_TAIL = [2, 555, 488, 630, 203]  # "<|im_start|>assistant\n" in the demo vocabulary


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return create_demo_model(tmp_path_factory.mktemp("detok") / "tandem-demo")


@pytest.fixture(scope="session")
def tok(demo_dir: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="session")
def sp_tok() -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace, byte fallback, leading-space strip), the
    Llama 2 / Mistral kind, whose single-token decodes lose spaces and emit U+FFFD per byte."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=80, show_progress=False)
    rust.train_from_iterator(TEXTS[:1] * 3 + ["the cat sat on the mat, and then it slept"],
                             trainer=trainer)
    spec = json.loads(rust.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    rust = RustTokenizer.from_str(json.dumps(spec))
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>",
                                             eos_token="</s>", unk_token="<unk>"))


def _feed(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    pieces, i = [], 0
    for size in sizes:
        pieces.append(detok.add(ids[i:i + size]))
        i += size
    assert i >= len(ids)
    return pieces


def _random_sizes(rng: random.Random, total: int) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < total:  # mostly small chunks, sometimes past the compaction threshold
        sizes.append(rng.randint(1, 8) if rng.random() < 0.8 else rng.randint(17, 40))
    return sizes


# -- the Tokenizer wrapper ------------------------------------------------------------------------

def test_tokenizer_matches_transformers(tok: Tokenizer) -> None:
    text = TEXTS[3]
    assert tok.encode(text) == tok.hf.encode(text) == [0, *tok.encode(text, False)]
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 4096 and tok.eos_token_ids == (1, 3) and tok.bos_token_id == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(messages)
    assert ids == tok.hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[-len(CHAT_PROMPT_TAIL):] == CHAT_PROMPT_TAIL
    assert tok.convert_ids_to_tokens([2, 5]) == ["<|im_start|>", tok.hf.convert_ids_to_tokens(5)]
    assert tok.is_special(3) and not tok.is_special(5)


@pytest.mark.parametrize("messages", [
    [{"role": "wizard", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"text": "no type"}]}],
])
def test_chat_template_failure_is_invalid_request(tok: Tokenizer, messages: list) -> None:
    with pytest.raises(InvalidRequest) as info:
        tok.apply_chat_template(messages)
    assert info.value.param == "messages" and "chat template" in info.value.message


def test_missing_chat_template_is_invalid_request(demo_dir: pathlib.Path,
                                                  tmp_path: pathlib.Path) -> None:
    copy = pathlib.Path(shutil.copytree(demo_dir, tmp_path / "no-template"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="no chat template"):
        Tokenizer.from_dir(copy).apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_directory_and_ids(tok: Tokenizer, tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidRequest, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    tok.check_token_ids([0, 4095])
    for bad in (4096, -1):
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            tok.check_token_ids([5, bad])


# -- decoding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", [[], CHAT_PROMPT_TAIL])
def test_streaming_equals_one_shot_decode(tok: Tokenizer, text: str, prompt: list[int]) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids)
    rng = random.Random(hash(text) & 0xFFFF)
    for sizes in [[1] * len(ids), [len(ids)]] + [_random_sizes(rng, len(ids)) for _ in range(30)]:
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = _feed(detok, ids, sizes)
        assert not any("\ufffd" in piece for piece in pieces), pieces
        pieces.append(detok.finish())
        assert "".join(pieces) == detok.text == expected
        assert detok.num_tokens == len(ids) and not detok.stopped


def test_multibyte_characters_really_split_across_tokens(tok: Tokenizer) -> None:
    # Guards the test above: without split characters it would prove nothing.
    for text in TEXTS[2:5]:
        assert any("\ufffd" in tok.decode([i]) for i in tok.encode(text, False)), text


@pytest.mark.parametrize("text", TEXTS[:5])
def test_sentencepiece_style_tokenizer(sp_tok: Tokenizer, text: str) -> None:
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert "".join(sp_tok.decode([i]) for i in ids) != sp_tok.decode(ids)  # the hard case
    rng = random.Random(1)
    for sizes in [[1] * len(ids)] + [_random_sizes(rng, len(ids)) for _ in range(20)]:
        detok = IncrementalDetokenizer(sp_tok)
        pieces = _feed(detok, ids, sizes)
        assert not any("\ufffd" in piece for piece in pieces)
        assert "".join(pieces) + detok.finish() == sp_tok.decode(ids)


def test_random_ids_like_an_untrained_model(tok: Tokenizer) -> None:
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 120))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = _feed(detok, ids, _random_sizes(rng, len(ids)))
        assert "".join(pieces) + detok.finish() == tok.decode(ids, skip)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there", False) + [3] + tok.encode(" more", False) + [1]
    kept = "Hi there<|im_end|> more<|end_of_text|>"
    for skip, expected in [(True, "Hi there more"), (False, kept)]:
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert "".join(detok.add([i]) for i in ids) + detok.finish() == expected


def test_finish_flushes_an_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🦒", False)  # not in the corpus: four byte tokens
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    assert "\ufffd" not in detok.add(ids[:cut])
    assert detok.text + detok.finish() == tok.decode(ids[:cut])
    with pytest.raises(RuntimeError):
        detok.add([5])


def test_prompt_ending_mid_character_is_not_glued_to_output(tok: Tokenizer) -> None:
    ids = tok.encode("中文 text", False)
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:1])  # a lone lead byte
    assert detok.add(ids[1:]) + detok.finish() == tok.decode(ids[1:])


# -- stop strings ---------------------------------------------------------------------------------

def _first_token_count(tok: Tokenizer, ids: list[int], stop: str) -> int:
    return next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))


@pytest.mark.parametrize("text,stop", [
    ("The cat sat on the mat. Then it slept.", "sat on"),
    ("The cat sat on the mat. Then it slept.", "mat. Th"),
    ("你好，世界！再见，朋友。", "世界"),
    ("party time 🎉🎉 and cake", "🎉🎉 and"),
    ("Hello there, friend", "Hel"),  # at the very start
    ("Hello there, friend", "friend"),  # at the very end
])
def test_stop_string_is_cut_exactly(tok: Tokenizer, text: str, stop: str) -> None:
    ids = tok.encode(text + " and text after the stop " + stop, False)
    expected = text[:text.index(stop)]
    rng = random.Random(5)
    for sizes in [[1] * len(ids), [len(ids)]] + [_random_sizes(rng, len(ids)) for _ in range(30)]:
        detok = IncrementalDetokenizer(tok, CHAT_PROMPT_TAIL, stop=["never matches", stop])
        pieces = _feed(detok, ids, sizes)
        assert detok.stopped and detok.matched_stop == stop
        assert "".join(pieces) == detok.text == expected
        assert detok.num_tokens == _first_token_count(tok, ids, stop)
        assert detok.add(tok.encode(" more", False)) == "" and detok.finish() == ""
        assert detok.text == expected


def test_stop_split_across_tokens_is_held_back_until_decided(tok: Tokenizer) -> None:
    ids = tok.encode("one two three", False)
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(tok, stop=[" two three"])
    first = detok.add(ids[:2])  # "one two": " two" may start the stop string
    assert first == "one" and not detok.stopped
    assert detok.add(ids[2:]) == "" and detok.stopped and detok.text == "one"


def test_first_stop_to_complete_wins(tok: Tokenizer) -> None:
    ids = tok.encode("xx abcdef yy", False)
    for sizes in ([1] * len(ids), [len(ids)]):
        detok = IncrementalDetokenizer(tok, stop=["abcdef", "bcd", "abc"])
        assert "".join(_feed(detok, ids, sizes)) == "xx " and detok.matched_stop == "abc"
        detok = IncrementalDetokenizer(tok, stop=["abcdef", "bcd"])
        assert "".join(_feed(detok, ids, sizes)) == "xx a" and detok.matched_stop == "bcd"


def test_finish_releases_a_partial_stop_that_never_completed(tok: Tokenizer) -> None:
    ids = tok.encode("This is the end", False)
    detok = IncrementalDetokenizer(tok, stop=["end of story", "xyz"])
    streamed = "".join(detok.add([i]) for i in ids)
    assert streamed == "This is the "  # "end" could still grow into the stop string
    assert detok.finish() == "end" and not detok.stopped
    assert detok.text == "This is the end" and detok.num_tokens == len(ids)


def test_random_stops_match_the_string_reference(tok: Tokenizer) -> None:
    rng = random.Random(11)
    for _ in range(300):
        text = rng.choice(TEXTS)
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 6)]
        ids = tok.encode(text, False)
        detok = IncrementalDetokenizer(tok, stop=[stop])
        out = "".join(_feed(detok, ids, _random_sizes(rng, len(ids)))) + detok.finish()
        assert out == text[:text.index(stop)], (text, stop)
        assert detok.stopped and detok.num_tokens == _first_token_count(tok, ids, stop)
