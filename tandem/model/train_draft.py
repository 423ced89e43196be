"""Distils the demo model into its draft model: `python -m tandem.model.train_draft --out DIR`.

The draft proposes tokens for speculative decoding, so what counts is how often its greedy next
token is the demo's. It is a LlamaForCausalLM of shape `demo.DRAFT_SPEC` (1 layer, hidden 32,
2 heads of 16 dims sharing 1 KV head, tied embeddings) with the demo's tokenizer, so token ids
match exactly: 146,432 multiply-adds per token against the demo's 663,552 (4.5 times fewer). The
4096-way output layer is most of either's cost, so the hidden size is what buys the saving; a
second layer measured no better on the held-out prompts (agreement 0.746 against 0.750). Writes
`model.safetensors` into DIR; the committed copy in `tandem/model/demo_draft_weights/` was made
with `python -m tandem.model.train_draft --out tandem/model/demo_draft_weights`, and
`demo.ensure_demo_model` installs it beside the demo's own tokenizer (`demo.draft_model_dir`).

What it learns from: the demo's next-token distributions (soft targets, the demo computed on each
batch as it comes) at the positions the demo itself writes, in
- the demo's training pieces (`train_demo.corpus_examples`), at the positions its loss counted;
- the demo's greedy continuations of those examples' prompts, which are exactly the sequences
  greedy speculative decoding walks along;
- continuations the demo sampled at `sample_temperature`, so the draft also sees the demo's
  words after contexts the corpus does not hold.
Every `holdout_every`-th corpus example is left out of all three, so `draft_eval` can measure the
draft on prompts it never saw.

Measured by `python -m tandem.model.draft_eval` (greedy, k = 4 drafts per step):

    prompts                n  positions  agreement   accepted/4  tokens/step
    held-out corpus       49       1887      0.750         2.44         2.66
    new chat messages     10        237      0.662         2.12         2.14

Training takes about 4 minutes of CPU time (one thread; 5 minutes on this 2-core machine).
Deterministic as `train_demo` is (fixed seeds, one thread, deterministic algorithms): a second run
wrote the committed bytes again. The demo's committed weights are the teacher (their digest is in
the weights' metadata), so a retrained demo needs a retrained draft.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tandem.model import demo, train_demo
from tandem.model.train_demo import IGNORE, Example, TrainConfig


@dataclass(frozen=True, slots=True)
class DistillConfig:
    """Hyperparameters; the defaults made the committed weights."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=2400, batch_size=16, max_len=160, lr=1e-2, warmup_steps=40))
    #: Every holdout_every-th corpus example is kept for measurement, not trained on.
    holdout_every: int = 10
    #: Plain paragraphs are prompted with their first tokens (chats with their user turns).
    min_prompt_tokens: int = 12
    continuation_tokens: int = 64
    #: Sampled continuations per prompt, besides the greedy one.
    num_samples: int = 6
    sample_temperature: float = 1.0
    generate_batch: int = 32


def split(examples: Sequence[Example], holdout_every: int) -> tuple[list[Example], list[Example]]:
    """(training examples, held-out examples): every holdout_every-th is held out."""
    held = [e for i, e in enumerate(examples) if i % holdout_every == holdout_every - 1]
    kept = [e for i, e in enumerate(examples) if i % holdout_every != holdout_every - 1]
    return kept, held


def prompt_ids(tokenizer: Any, example: Example, min_tokens: int) -> list[int]:
    """What precedes the example's first counted token (a chat's user turn and the assistant's
    header), or its first `min_tokens` tokens if that is longer (plain text, whose counted part
    starts right after BOS)."""
    ids, counted = train_demo.tokens(tokenizer, example)
    return ids[:max(counted.index(True), min_tokens)]


def load_teacher(tokenizer: Any) -> Any:
    """The demo model with its committed weights, in eval mode (built from the committed files
    alone: an installed demo directory needs the draft this script makes)."""
    return with_weights(tokenizer, demo.DEMO_SPEC, demo.committed_file(demo.WEIGHTS_FILE)
                        .read_bytes())


def with_weights(tokenizer: Any, spec: demo.DemoSpec, weights: bytes) -> Any:
    """A LlamaForCausalLM of shape `spec` holding `weights` (safetensors bytes), in eval mode.
    Raises ValueError if they do not fit."""
    from safetensors.torch import load

    model = train_demo.build_model(tokenizer, spec, seed=0)
    missing, unexpected = model.load_state_dict(load(weights), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to embed_tokens
        raise ValueError(f"the weights do not fit {spec}: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.eval()


def continuations(model: Any, prompts: Sequence[list[int]], config: DistillConfig,
                  pad_id: int, temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """The model's continuation of each prompt (greedy at temperature 0, else sampled from
    `seed`), up to and including an end-of-turn token or `continuation_tokens` tokens. Batched
    with left padding, so a near-tie may go the other way than unbatched; these are training
    data, not references."""
    import torch

    torch.manual_seed(seed)
    eos = set(model.config.eos_token_id)
    out: list[list[int]] = []
    for start in range(0, len(prompts), config.generate_batch):
        batch = prompts[start:start + config.generate_batch]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature \
            else {"do_sample": False}
        with torch.inference_mode():
            generated = model.generate(ids, attention_mask=mask, pad_token_id=pad_id,
                                       max_new_tokens=config.continuation_tokens, **sampling)
        for row in generated[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in eos]
            out.append(row[:ends[0] + 1] if ends else row)
    return out


def distillation_pieces(tokenizer: Any, teacher: Any, examples: Sequence[Example],
                        config: DistillConfig, log: Any = print) -> list[tuple[list[int],
                                                                                list[int]]]:
    """The corpus pieces, then the teacher's continuations of the examples' prompts, as
    `train_demo.encode` pieces (labels mark the positions the loss counts)."""
    pad_id = demo.special_token_ids(tokenizer)[demo.PAD_TOKEN]
    max_len = config.train.max_len
    pieces = [p for example in examples for p in train_demo.encode(tokenizer, example, max_len)]
    prompts = [prompt_ids(tokenizer, e, config.min_prompt_tokens) for e in examples]
    runs = [(0.0, 0)] + [(config.sample_temperature, config.train.seed * 1000 + i + 1)
                         for i in range(config.num_samples)]
    for temperature, seed in runs:
        started = time.monotonic()
        for prompt, tail in zip(prompts, continuations(teacher, prompts, config, pad_id,
                                                       temperature, seed)):
            pieces += train_demo.cut(prompt + tail, [False] * len(prompt) + [True] * len(tail),
                                     max_len)
        log(f"continuations at temperature {temperature}: {len(prompts)} in "
            f"{time.monotonic() - started:.0f}s")
    return pieces


def distillation_loss(teacher: Any) -> train_demo.LossFn:
    """Cross-entropy against the teacher's next-token distribution where labels are not
    IGNORE (the corpus's own next tokens are not used: the teacher's beliefs are the target)."""
    import torch

    def loss(model: Any, ids: Any, labels: Any) -> Any:
        counted = labels != IGNORE
        with torch.no_grad():
            target = torch.softmax(teacher(input_ids=ids).logits[counted], dim=-1)
        return torch.nn.functional.cross_entropy(model(input_ids=ids).logits[counted], target)

    return loss


def distill(tokenizer: Any, teacher: Any, examples: Sequence[Example], config: DistillConfig,
            log: Any = print) -> tuple[Any, list[float]]:
    """Trains a fresh DRAFT_SPEC model to imitate `teacher` on `examples` (all of them: hold
    out with `split` first); returns it in eval mode and the loss of every step."""
    pieces = distillation_pieces(tokenizer, teacher, examples, config, log)
    model = train_demo.build_model(tokenizer, demo.DRAFT_SPEC, config.train.seed)
    pad_id = demo.special_token_ids(tokenizer)[demo.PAD_TOKEN]
    return train_demo.fit(model, pieces, config.train, distillation_loss(teacher), pad_id, log)


def committed_tokenizer() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(demo.committed_file(demo.TOKENIZER_FILE).read_text("utf-8"))


def main(argv: Sequence[str] | None = None) -> None:
    defaults = DistillConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path,
                        help="directory for model.safetensors")
    parser.add_argument("--steps", type=int, default=defaults.train.steps)
    parser.add_argument("--seed", type=int, default=defaults.train.seed)
    args = parser.parse_args(argv)
    config = replace(defaults, train=replace(defaults.train, steps=args.steps, seed=args.seed))
    train_demo.make_deterministic()
    started = time.monotonic()
    tokenizer = committed_tokenizer()
    kept, _ = split(train_demo.corpus_examples(train_demo.corpus_text()), config.holdout_every)
    model, losses = distill(tokenizer, load_teacher(tokenizer), kept, config)
    args.out.mkdir(parents=True, exist_ok=True)
    recent = losses[-config.train.log_every:]
    final = sum(recent) / len(recent)
    train_demo.save_weights(model, args.out / demo.WEIGHTS_FILE, demo.DRAFT_SPEC, {
        "tandem_distill_config": json.dumps(asdict(config), sort_keys=True),
        "tandem_final_loss": f"{final:.4f}",
        "tandem_teacher_sha256": demo.committed_digests()[demo.WEIGHTS_FILE],
        "tandem_versions": json.dumps(train_demo.versions(), sort_keys=True),
    })
    print(f"wrote {args.out} in {time.monotonic() - started:.0f}s; final loss {final:.4f}")


if __name__ == "__main__":
    main()
