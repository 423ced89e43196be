"""Long prompts that share a beginning reuse its token ids: always the ids a whole encoding gives
(byte-level BPE and a Metaspace tokenizer, with and without added special tokens, unicode,
punctuation, newlines and special tokens in the text), the reuse really happens, a tokenizer
that splits differently turns the cache off, and the cache is bounded."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.frontend.prefix_tokens import PrefixHit, PrefixTokenCache, _Kept
from tandem.frontend.tokenizer import OFF_LOOP_CHARS, Tokenizer
from tandem.model.demo import ensure_demo_model

WORDS = ["the", "quick", "brown", "fox", "über", "naïve", "東京", "emoji🙂", "x1", "42", "don't",
         "(a,b)", "end.", "\n", "\n\n", "  ", "<|im_start|>", "-", "→"]


def text_of(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model())


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    rust = RustTokenizer(models.BPE(unk_token="<unk>"))
    rust.normalizer = normalizers.NFKC()
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Metaspace()
    corpus = [text_of(random.Random(i), 200) for i in range(50)]
    rust.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600,
                                                         special_tokens=["<unk>", "<s>"],
                                                         show_progress=False))
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>",
                                             unk_token="<unk>"))


@pytest.fixture(scope="module")
def words() -> Tokenizer:
    """Word-level over whitespace (as ../shared/peers' benchmark model): no token holds a
    space."""
    vocab = {"<unk>": 0, "<s>": 1}
    for word in " ".join(WORDS).split():
        vocab.setdefault(word, len(vocab))
    rust = RustTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>",
                                             unk_token="<unk>"))


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("name", ["demo", "metaspace", "words"])
async def test_shared_beginnings_give_the_whole_encodings_ids(
        name: str, special: bool, request: pytest.FixtureRequest) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(7)
    shared = text_of(rng, 3000)
    assert len(shared) > 3 * OFF_LOOP_CHARS
    for i in range(6):
        text = shared + " " + text_of(rng, 50 + i * 40)
        assert (await tokenizer.encode_off_loop(text, add_special_tokens=special)
                == tokenizer.encode(text, add_special_tokens=special)), i
        # A beginning cut inside the shared part, then something else.
        cut = len(shared) // (i + 2)
        other = shared[:cut] + "?" + text_of(rng, 900)
        assert (await tokenizer.encode_off_loop(other, add_special_tokens=special)
                == tokenizer.encode(other, add_special_tokens=special)), i


async def test_byte_level_prompts_reuse_their_beginning(demo: Tokenizer) -> None:
    rng = random.Random(3)
    shared = text_of(rng, 4000)
    cache = demo._prefix_cache
    hits = cache.num_hits
    for _ in range(4):
        text = shared + " " + text_of(rng, 30)
        assert await demo.encode_off_loop(text, add_special_tokens=False) == \
            demo.encode(text, add_special_tokens=False)
    assert cache.enabled
    assert cache.num_hits - hits >= 3  # every prompt after the first


def test_a_tokenizer_that_splits_differently_turns_the_cache_off(demo: Tokenizer) -> None:
    cache = PrefixTokenCache(demo.backend)
    hit = PrefixHit(10, (1, 2), _Kept((1, 2, 3)))
    assert cache.check(hit, [1, 2, 3], [1, 2, 3]) and hit.kept.verified
    assert not cache.check(PrefixHit(10, (1, 2), _Kept((1, 2, 3))), [1, 2, 4], [1, 2, 3])
    assert not cache.enabled
    text = text_of(random.Random(1), 2000)
    encoding = demo.backend.encode(text, add_special_tokens=False)
    cache.keep(text, encoding.ids, encoding.offsets)
    assert cache.lookup(text + " more") is None


def test_kept_texts_are_bounded(demo: Tokenizer) -> None:
    cache = PrefixTokenCache(demo.backend, max_texts=2)
    texts = [text_of(random.Random(seed), 1500) for seed in range(3)]
    for text in texts:
        encoding = demo.backend.encode(text, add_special_tokens=False)
        cache.keep(text, encoding.ids, encoding.offsets)
    assert cache.lookup(texts[0] + " tail") is None  # the least recently used went first
    for text in texts[1:]:
        hit = cache.lookup(text + " tail")
        assert hit is not None and hit.cut > len(text) // 2
