"""Trains the demo model's weights on the bundled corpus: `python -m tandem.model.train_demo --out DIR`.

Writes `tokenizer.json` (trained first, as `demo.train_tokenizer` does) and `model.safetensors` into
DIR. The committed copies in `tandem/model/demo_weights/` were made with
`python -m tandem.model.train_demo --out tandem/model/demo_weights`; `ensure_demo_model` installs
them, it never trains.

What the model learns from: `demo_corpus.txt` turned into ChatML conversations (a heading answered
by its section's first paragraph, a sentence answered by the sentences that follow it, the
corpus's questions and answers, the lines of its dialogues as turns) and into plain paragraphs.
The loss counts only what the model will be asked to write: assistant turns with their closing
`<|im_end|>`, and plain text with its closing `<|end_of_text|>`. So a chat answer is corpus-like
English that ends on its own; the model cannot follow instructions or know anything beyond
those 39 KB of text.

Deterministic: a fixed seed for the initial weights and for the data order, one CPU thread and
deterministic algorithms, so two runs on one machine with the same torch, transformers and
tokenizers versions write identical bytes. Across machines the bytes may differ (other SIMD
kernels round differently) and so may, in the last digits, the losses printed.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from tandem.model import demo

#: One training example: text segments with whether the loss counts their tokens.
Segment = tuple[str, bool]
Example = list[Segment]
#: Labels of tokens the loss ignores (torch's cross_entropy default).
IGNORE = -100


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Hyperparameters; the defaults made the committed weights."""

    steps: int = 800
    batch_size: int = 16
    #: Longer examples are cut into pieces of at most this many tokens.
    max_len: int = 160
    lr: float = 3e-3
    warmup_steps: int = 30
    #: The cosine schedule ends at lr * min_lr_ratio.
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 25


def corpus_text() -> str:
    return resources.files("tandem.model").joinpath("demo_corpus.txt").read_text("utf-8")


def chat(*turns: str) -> Example:
    """A ChatML conversation rendered exactly as `demo.CHAT_TEMPLATE` renders it; turns alternate
    user, assistant, user, ... The loss counts assistant content and its `<|im_end|>`."""
    segments: Example = [(demo.BOS_TOKEN, False)]
    for i, content in enumerate(turns):
        role = "user" if i % 2 == 0 else "assistant"
        segments += [(f"{demo.IM_START_TOKEN}{role}\n", False),
                     (content + demo.IM_END_TOKEN, role == "assistant"), ("\n", False)]
    return segments


def plain(text: str) -> Example:
    return [(demo.BOS_TOKEN, False), (text + demo.EOS_TOKEN, True)]


# A sentence ends at . ! ? (and a closing quote) before a space and a capital or a quote, except
# after the titles the corpus uses.
_SENTENCE_END = re.compile(r'(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?:(?<=[.!?])|(?<=[.!?]"))\s+(?=["A-Z])')


def sentences(paragraph: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(paragraph.strip()) if s]


def _is_heading(paragraph: str) -> bool:
    return ("\n" not in paragraph and len(paragraph) < 50
            and not paragraph.rstrip().endswith((".", "!", "?", ":", '"')))


def corpus_examples(corpus: str) -> list[Example]:
    """Every training example the corpus yields, in corpus order."""
    examples: list[Example] = []
    paragraphs = [p for p in corpus.split("\n\n") if p.strip()]
    heading: str | None = None
    for paragraph in paragraphs:
        text = paragraph.strip("\n")
        if _is_heading(text):
            heading = text
            continue
        examples.append(plain(text))
        lines = text.split("\n")
        if heading is not None:  # a section's first paragraph answers its heading
            examples.append(chat(heading, text))
            heading = None
        if text.startswith("Q: ") and len(lines) == 2 and lines[1].startswith("A: "):
            examples.append(chat(lines[0][3:], lines[1][3:]))
        elif len(lines) > 1 and all(line.startswith('"') for line in lines):
            turns = [line.strip('"') for line in lines]
            examples.append(chat(*turns))  # the whole dialogue, and each exchange on its own
            examples += [chat(turns[i], turns[i + 1]) for i in range(len(turns) - 1)]
        elif len(lines) > 1 and not text.startswith(" "):  # notes, phrases: one line each
            examples += [chat(lines[i], lines[i + 1]) for i in range(len(lines) - 1)]
        elif len(lines) == 1:
            parts = sentences(text)
            examples += [chat(parts[i], " ".join(parts[i + 1:i + 3]))
                         for i in range(len(parts) - 1)]
    return examples


def tokens(tokenizer: Any, example: Example) -> tuple[list[int], list[bool]]:
    """The example's token ids, and for each whether the loss counts it."""
    ids: list[int] = []
    counted: list[bool] = []
    for text, trained in example:
        piece = tokenizer.encode(text, add_special_tokens=False).ids
        ids += piece
        counted += [trained] * len(piece)
    return ids, counted


def encode(tokenizer: Any, example: Example, max_len: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) pieces of at most `max_len` tokens; labels[i] is the target of
    position i (the next token) or IGNORE."""
    return cut(*tokens(tokenizer, example), max_len)


def cut(ids: list[int], counted: list[bool], max_len: int) -> list[tuple[list[int], list[int]]]:
    """`encode`'s pieces of a token sequence."""
    # The last token is no input: nothing follows it.
    inputs = ids[:-1]
    labels = [ids[i + 1] if counted[i + 1] else IGNORE for i in range(len(inputs))]
    return [(inputs[start:start + max_len], labels[start:start + max_len])
            for start in range(0, len(inputs), max_len)]


def batches(pieces: Sequence[tuple[list[int], list[int]]], config: TrainConfig,
            pad_id: int) -> Iterator[tuple[Any, Any]]:
    """Endless (input ids, labels) batches. Each epoch shuffles the pieces with its own seed and
    groups pieces of similar length (less padding); padding goes on the right, where causal
    attention keeps it from changing the real tokens, and its labels are IGNORE."""
    import torch

    epoch = 0
    while True:
        rng = random.Random(config.seed * 1_000_003 + epoch)
        order = list(range(len(pieces)))
        rng.shuffle(order)
        group = config.batch_size * 8
        epoch_batches = []
        for start in range(0, len(order), group):
            chunk = sorted(order[start:start + group], key=lambda i: len(pieces[i][0]))
            epoch_batches += [chunk[i:i + config.batch_size]
                              for i in range(0, len(chunk), config.batch_size)]
        rng.shuffle(epoch_batches)
        for batch in epoch_batches:
            width = max(len(pieces[i][0]) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
            for row, i in enumerate(batch):
                piece_ids, piece_labels = pieces[i]
                ids[row, :len(piece_ids)] = torch.tensor(piece_ids)
                labels[row, :len(piece_labels)] = torch.tensor(piece_labels)
            yield ids, labels
        epoch += 1


def build_model(tokenizer: Any, spec: demo.DemoSpec, seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = LlamaConfig(**demo.model_config(spec, vocab_size, demo.special_token_ids(tokenizer)))
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def train(tokenizer: Any, examples: Sequence[Example], config: TrainConfig,
          spec: demo.DemoSpec = demo.DEMO_SPEC, log: Any = print) -> tuple[Any, list[float]]:
    """Trains a fresh model on `examples`; returns it (in eval mode) and the loss of every step.
    Reproducible given torch's thread count (main sets one thread)."""
    model = build_model(tokenizer, spec, config.seed)
    pieces = [p for example in examples for p in encode(tokenizer, example, config.max_len)]
    log(f"data: {len(examples)} examples")
    pad_id = demo.special_token_ids(tokenizer)[demo.PAD_TOKEN]
    return fit(model, pieces, config, next_token_loss, pad_id, log)


#: loss(model, input ids, labels) -> a scalar tensor to minimise; labels as `encode` makes them.
LossFn = Callable[[Any, Any, Any], Any]


def next_token_loss(model: Any, ids: Any, labels: Any) -> Any:
    """Cross-entropy against the corpus's next tokens where labels are not IGNORE."""
    import torch

    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)


def fit(model: Any, pieces: Sequence[tuple[list[int], list[int]]], config: TrainConfig,
        loss_fn: LossFn, pad_id: int, log: Any = print) -> tuple[Any, list[float]]:
    """AdamW with warmup and a cosine schedule over `batches(pieces)`, minimising `loss_fn`;
    returns the model (in eval mode) and the loss of every step."""
    import torch

    num_params = sum(p.numel() for p in model.parameters())
    num_targets = sum(sum(label != IGNORE for label in labels) for _, labels in pieces)
    log(f"model: {num_params:,} parameters; data: {len(pieces)} pieces, {num_targets:,} target "
        f"tokens; {config.steps} steps of {config.batch_size}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))
    data = batches(pieces, config, pad_id)
    losses: list[float] = []
    model.train()
    start = time.monotonic()
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config)
        ids, labels = next(data)
        loss = loss_fn(model, ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            recent = losses[-config.log_every:]
            log(f"step {step + 1:4d}/{config.steps}  loss {sum(recent) / len(recent):.4f}  "
                f"lr {_lr(step, config):.2e}  {time.monotonic() - start:6.1f}s")
    return model.eval(), losses


def make_deterministic() -> None:
    """One thread (the reduction order of a matmul depends on how it is split across threads)
    and deterministic algorithms: what makes a training run reproducible byte for byte."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def _lr(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def save_weights(model: Any, path: pathlib.Path, spec: demo.DemoSpec,
                 metadata: dict[str, str]) -> None:
    """float32 safetensors with the tied embedding stored once, as transformers saves it."""
    from safetensors.torch import save

    state = model.state_dict()
    shapes = demo.weight_shapes(spec, model.config.vocab_size)
    tensors = {name: state[name].detach().to("cpu").contiguous().clone() for name in shapes}
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise RuntimeError(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")
    path.write_bytes(canonical_safetensors(save(tensors, metadata={"format": "pt", **metadata})))


def canonical_safetensors(blob: bytes) -> bytes:
    """The same file with its JSON header's keys sorted: safetensors writes the metadata map in
    hash order, which changes from one process to the next, and the committed bytes must be
    reproducible. Tensor offsets count from the end of the header, so they stay valid; the
    header is padded with spaces to 8 bytes as the format asks."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + size])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + size:]


def chat_prompt(tokenizer: Any, message: str) -> list[int]:
    """The token ids of one user message and the assistant's header, as the chat template
    renders them with add_generation_prompt."""
    prompt = [*chat(message), (f"{demo.IM_START_TOKEN}assistant\n", False)]
    return [i for text, _ in prompt for i in tokenizer.encode(text, add_special_tokens=False).ids]


def greedy_chat(model: Any, tokenizer: Any, message: str, max_new_tokens: int = 40) -> str:
    """The model's greedy answer to one user message, decoded without special tokens."""
    import torch

    ids = chat_prompt(tokenizer, message)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens)
    return str(tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))


def versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {"tokenizers": tokenizers.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def main(argv: Sequence[str] | None = None) -> None:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path,
                        help="directory for tokenizer.json and model.safetensors")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    config = TrainConfig(steps=args.steps, seed=args.seed)
    make_deterministic()
    started = time.monotonic()
    tokenizer = demo.train_tokenizer(demo.DEMO_SPEC)
    model, losses = train(tokenizer, corpus_examples(corpus_text()), config)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / demo.TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True), encoding="utf-8",
                                             newline="\n")
    final = sum(losses[-config.log_every:]) / len(losses[-config.log_every:])
    save_weights(model, args.out / demo.WEIGHTS_FILE, demo.DEMO_SPEC, {
        "tandem_train_config": json.dumps(asdict(config), sort_keys=True),
        "tandem_final_loss": f"{final:.4f}",
        # What made these bytes: another version of any of them may train other ones.
        "tandem_versions": json.dumps(versions(), sort_keys=True),
    })
    print(f"wrote {args.out} in {time.monotonic() - started:.0f}s; final loss {final:.4f}")
    for message in ("Hello!", "The weather", "What would you like to drink?"):
        print(f"  {message!r} -> {greedy_chat(model, tokenizer, message)!r}")


if __name__ == "__main__":
    main()
