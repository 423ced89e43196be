"""The demo model's training script: what it trains on, that it learns, that it is reproducible."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from tandem.model import demo, train_demo

#: A few seconds of training on a slice of the corpus.
QUICK = train_demo.TrainConfig(steps=30, batch_size=8, max_len=64, warmup_steps=5, log_every=10)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    # The committed tokenizer, the one the committed weights were trained with.
    return Tokenizer.from_str(demo.committed_file(demo.TOKENIZER_FILE).read_text("utf-8"))


@pytest.fixture(scope="module")
def examples() -> list[train_demo.Example]:
    return train_demo.corpus_examples(train_demo.corpus_text())


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _text(example: train_demo.Example) -> str:
    return "".join(text for text, _ in example)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def test_chat_examples_render_as_the_chat_template(tmp_path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(demo.create_demo_model(tmp_path / "m")))
    turns = ["Have you seen my keys?", "They're on the table by the door.", "Thanks."]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": turn}
                for i, turn in enumerate(turns)]
    assert _text(train_demo.chat(*turns)) == hf.apply_chat_template(messages, tokenize=False)


def test_only_answers_are_trained(tokenizer) -> None:
    example = train_demo.chat("What would you like to drink?", "A pot of tea.")
    [(ids, labels)] = train_demo.encode(tokenizer, example, max_len=100)
    targets = [label for label in labels if label != train_demo.IGNORE]
    assert tokenizer.decode(targets, skip_special_tokens=False) == "A pot of tea.<|im_end|>"
    # labels[i] is the token after position i, or ignored
    assert all(label in (train_demo.IGNORE, after) for label, after in zip(labels, ids[1:]))
    assert len(ids) == len(labels)
    [(_, labels)] = train_demo.encode(tokenizer, train_demo.plain("Hello."), max_len=100)
    assert tokenizer.decode(labels, skip_special_tokens=False) == "Hello.<|end_of_text|>"


def test_corpus_examples(examples: list[train_demo.Example], tokenizer) -> None:
    texts = {_text(e) for e in examples}
    assert _text(train_demo.chat(  # a section's heading answered by its first paragraph
        "The weather", "It rained all night and the streets are still wet. The forecast says the "
        "clouds will clear by noon, with a high of 18 degrees and a light wind from the west. "
        "Tomorrow should be warmer, around 22 degrees, and the weekend looks dry. In winter the "
        "temperature here often drops below zero, and the pond in the park freezes thick enough "
        "for children to slide on it, although the signs say they should not.")) in texts
    assert _text(train_demo.chat(  # a question and its answer
        "How many legs does a spider have?",
        "Eight. Insects have six, which is one way to tell them apart.")) in texts
    assert _text(train_demo.chat(  # an exchange of a dialogue, without its quotes
        "What would you like to drink?",
        "A pot of tea for two, please, and a glass of water.")) in texts
    assert _text(train_demo.chat(  # a sentence answered by the next ones; "Mrs." ends none
        "My neighbour, Mrs. Patel, walks her dog at exactly 7:10 every morning.",
        "She says the dog, a small brown terrier called Biscuit, knows the time better than any "
        "clock. They go around the block twice, stop at the bakery on the corner for a "
        "croissant, and come back before the school buses arrive.")) in texts
    assert len(examples) > 400
    # Encoding piece by piece gives the tokens of the whole text, which is what the frontend
    # encodes: training sees prompts tokenized as serving will.
    for example in examples:
        pieces = [i for text, _ in example for i in _encode(tokenizer, text)]
        assert pieces == _encode(tokenizer, _text(example))


def test_long_examples_are_cut(tokenizer, examples: list[train_demo.Example]) -> None:
    longest = max(examples, key=lambda e: len(_text(e)))
    pieces = train_demo.encode(tokenizer, longest, max_len=64)
    assert len(pieces) > 1 and all(len(ids) == len(labels) <= 64 for ids, labels in pieces)
    assert [i for ids, _ in pieces for i in ids] == _encode(tokenizer, _text(longest))[:-1]


def test_loss_goes_down(tokenizer, examples: list[train_demo.Example], one_thread: None) -> None:
    _, losses = train_demo.train(tokenizer, examples[:64], QUICK, log=lambda _: None)
    assert len(losses) == QUICK.steps
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


def test_training_is_reproducible(tokenizer, examples: list[train_demo.Example],
                                  one_thread: None) -> None:
    config = dataclasses.replace(QUICK, steps=4)
    runs = [train_demo.train(tokenizer, examples[:32], config, log=lambda _: None)
            for _ in range(2)]
    (first, first_losses), (second, second_losses) = runs
    assert first_losses == second_losses
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert a.equal(b), name
    other, _ = train_demo.train(tokenizer, examples[:32], dataclasses.replace(config, seed=1),
                                log=lambda _: None)
    assert not other.model.embed_tokens.weight.equal(first.model.embed_tokens.weight)


def test_saved_weights_are_the_same_bytes_whatever_the_metadata_order(tmp_path) -> None:
    """safetensors writes its metadata map in hash order (per process); the saved file must
    not depend on it, or a retrained copy of identical tensors would differ from the committed
    one. The canonical file still loads, with the same tensors and metadata."""
    from safetensors import safe_open
    from safetensors.torch import load, save

    tensors = {"b": torch.arange(3.0), "a": torch.ones(2, 2)}
    orders = [{"x": "1", "y": "2", "format": "pt"}, {"format": "pt", "y": "2", "x": "1"}]
    blobs = [train_demo.canonical_safetensors(save(tensors, metadata=m)) for m in orders]
    assert blobs[0] == blobs[1] and (8 + int.from_bytes(blobs[0][:8], "little")) % 8 == 0
    loaded = load(blobs[0])
    assert all(loaded[k].equal(v) for k, v in tensors.items())
    (tmp_path / "w.safetensors").write_bytes(blobs[0])
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert f.metadata() == orders[0]
    committed = demo.committed_file(demo.WEIGHTS_FILE).read_bytes()
    assert train_demo.canonical_safetensors(committed) == committed
