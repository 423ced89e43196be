"""How well the draft model predicts the demo model: `python -m tandem.model.draft_eval`.

For each prompt the demo (the target) writes its greedy continuation, and the draft is measured
along it, as greedy speculative decoding would use it:
- agreement: the fraction of positions where the draft's greedy next token, given the demo's
  context, is the demo's token (the acceptance rate of a single draft token);
- accepted/k: at each position, how many of the draft's next k greedy tokens (drafted one after
  another from the demo's context) are the demo's next k, averaged over positions;
- tokens/step: walking each continuation as the engine would (accept the leading drafts that
  match, then the demo's own next token), the tokens written per forward pass of the demo.
The prompts are the corpus examples `train_draft` held out, and chat messages not in the corpus.
Runs both models with transformers, on the CPU.
"""
from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.model import demo, train_demo, train_draft

#: Chat messages the corpus does not hold, in its register.
NEW_MESSAGES = (
    "Hello!", "Good morning.", "What would you like to drink?", "Where is the station?",
    "Tell me about your garden.", "How do you make bread?", "What time is it?",
    "I am tired today.", "Thank you very much.", "The weather",
)


@dataclass(frozen=True, slots=True)
class Measurement:
    num_prompts: int
    #: Positions of the demo's continuations the draft was measured at.
    num_positions: int
    agreement: float
    k: int
    mean_accepted: float
    tokens_per_step: float


def greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The model's greedy continuation of `prompt`, up to and including an end-of-turn token."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens)
    return [int(t) for t in out[0, len(prompt):]]


def drafts(draft: Any, ids: list[int], start: int, k: int) -> list[list[int]]:
    """For each position i in [start, len(ids)): the draft's k greedy tokens after ids[:i].

    All positions in one batch, each context right-aligned to its own length: causal attention
    keeps what follows a row's context (padding, other drafts) from changing its logits."""
    import torch

    positions = range(start, len(ids))
    rows = torch.tensor([ids] * len(positions))
    rows = torch.cat([rows, torch.zeros(len(positions), k, dtype=torch.long)], dim=1)
    lengths = torch.tensor(list(positions))
    index = torch.arange(len(positions))
    out = []
    with torch.inference_mode():
        for _ in range(k):
            width = int(lengths.max())
            logits = draft(input_ids=rows[:, :width]).logits
            tokens = logits[index, lengths - 1].argmax(dim=-1)
            rows[index, lengths] = tokens
            lengths = lengths + 1
            out.append(tokens)
    return torch.stack(out, dim=1).tolist()


def accepted(proposed: list[int], actual: Sequence[int]) -> int:
    """How many leading proposed tokens are the actual ones."""
    count = 0
    for mine, theirs in zip(proposed, actual):
        if mine != theirs:
            break
        count += 1
    return count


def measure(draft: Any, target: Any, prompts: Sequence[list[int]], k: int = 4,
            max_new_tokens: int = 48) -> Measurement:
    positions = agree = total_accepted = tokens = steps = 0
    for prompt in prompts:
        ids = prompt + greedy(target, prompt, max_new_tokens)
        start = len(prompt)
        counts = [accepted(d, ids[start + j:start + j + k])
                  for j, d in enumerate(drafts(draft, ids, start, k))]
        positions += len(counts)
        agree += sum(c > 0 for c in counts)
        total_accepted += sum(counts)
        i = start
        while i < len(ids):  # accept the matching drafts and the target's own next token
            i += counts[i - start] + 1
            steps += 1
        tokens += len(ids) - start
    return Measurement(len(prompts), positions, agree / positions, k,
                       total_accepted / positions, tokens / steps)


def eval_prompts(tokenizer: Any) -> dict[str, list[list[int]]]:
    """The prompt sets draft_eval reports on, by name."""
    config = train_draft.DistillConfig()
    _, held = train_draft.split(train_demo.corpus_examples(train_demo.corpus_text()),
                                config.holdout_every)
    return {
        "held-out corpus": [train_draft.prompt_ids(tokenizer, e, config.min_prompt_tokens)
                            for e in held],
        "new chat messages": [train_demo.chat_prompt(tokenizer, m) for m in NEW_MESSAGES],
    }


def multiply_adds_per_token(spec: demo.DemoSpec) -> int:
    """Of the weight matrices, for one token (attention over the context left out): the tied
    embedding counts once, as the output layer; looking a token up costs nothing."""
    shapes = demo.weight_shapes(spec, spec.vocab_size).values()
    return sum(math.prod(shape) for shape in shapes if len(shape) == 2)


def format_table(rows: dict[str, Measurement]) -> str:
    k = next(iter(rows.values())).k
    lines = [f"{'prompts':<20}{'n':>4}{'positions':>11}{'agreement':>11}"
             f"{f'accepted/{k}':>13}{'tokens/step':>13}"]
    lines += [f"{name:<20}{m.num_prompts:>4}{m.num_positions:>11}{m.agreement:>11.3f}"
              f"{m.mean_accepted:>13.2f}{m.tokens_per_step:>13.2f}" for name, m in rows.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=pathlib.Path,
                        help="a draft model.safetensors to measure (default: the installed "
                             "demo's draft)")
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = train_draft.committed_tokenizer()
    if args.weights is not None:
        draft = train_draft.with_weights(tokenizer, demo.DRAFT_SPEC, args.weights.read_bytes())
    else:
        path = demo.draft_model_dir(demo.ensure_demo_model())
        draft = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    target = train_draft.load_teacher(tokenizer)
    rows = {name: measure(draft, target, prompts, args.k, args.max_new_tokens)
            for name, prompts in eval_prompts(tokenizer).items()}
    print(format_table(rows))
    target_cost, draft_cost = (multiply_adds_per_token(s) for s in (demo.DEMO_SPEC,
                                                                   demo.DRAFT_SPEC))
    print(f"multiply-adds per token: demo {target_cost:,}, draft {draft_cost:,} "
          f"({target_cost / draft_cost:.1f} times fewer)")


if __name__ == "__main__":
    main()
