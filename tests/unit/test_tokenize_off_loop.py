"""Tokenizer.encode gives the Rust encoder's ids; long prompts are tokenized off the event loop:
same ids as Tokenizer.encode, and the loop keeps running meanwhile (tokenizers' encode holds the
GIL; encode_batch on a worker thread does not)."""
from __future__ import annotations

import asyncio

import pytest

from tandem.frontend.tokenizer import OFF_LOOP_CHARS, Tokenizer
from tandem.model.demo import ensure_demo_model


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model())


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("words", [3, OFF_LOOP_CHARS])  # inline, then on a worker thread
async def test_same_ids_as_encode(tokenizer: Tokenizer, special: bool, words: int) -> None:
    text = " ".join(f"word{i % 97} über" for i in range(words))
    assert (await tokenizer.encode_off_loop(text, add_special_tokens=special)
            == tokenizer.encode(text, add_special_tokens=special))


async def test_the_loop_runs_while_a_long_prompt_is_encoded(tokenizer: Tokenizer) -> None:
    text = "the quick brown fox jumps over the lazy dog " * 30_000  # ~0.1-0.5 s to encode
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is running
    await tokenizer.encode_off_loop(text)
    done = True
    await task
    # Encoding inline would hold the loop for the whole encode: the ticker could tick at most
    # once. On a worker thread it ticks all along.
    assert ticks >= 5


@pytest.mark.parametrize("special", [True, False])
def test_encode_gives_the_rust_tokenizers_own_ids(tokenizer: Tokenizer, special: bool) -> None:
    """Tokenizer.encode skips the offsets (encode_batch_fast): the ids stay the encoder's,
    special-token text, whitespace runs and non-ASCII included."""
    eos = tokenizer.hf.eos_token or ""
    for text in ("Hello world", f"a {eos} b{eos}", "  spaced\n\n  out\t", "über naïve 東京 🙂",
                 " ".join(f"w{i}" for i in range(300))):
        assert (tokenizer.encode(text, add_special_tokens=special)
                == tokenizer.backend.encode(text, add_special_tokens=special).ids), text
