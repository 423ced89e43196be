"""Verification of one request's chain of proposed tokens against the target's distributions.

A chain (not a tree): proposals x_1..x_k were made one after another; the target pass scored
k + 1 positions, row i being the target's next-token distribution after the context plus
x_1..x_i. The result is 1..k+1 tokens to emit: the accepted prefix of the proposals, then one
token of the target's own (the correction at the first rejection, or the bonus token after row k
when all k were accepted). So every verify pass emits at least the token a plain step would.

- Greedy: accept while x_i equals the target's argmax; the first mismatch is replaced by the
  argmax. The output is exactly plain greedy decoding's.
- Sampling (Leviathan et al. 2023, Chen et al. 2023): accept x_i with probability
  min(1, p(x_i) / q(x_i)); at the first rejection draw from normalize(max(0, p - q)). Each
  emitted token then follows p exactly, whatever q is. A deterministic proposer (n-gram) has a
  one-hot q: accept with probability p(x_i), on rejection draw from p with x_i removed.

p must be the distribution the non-speculative sampler would draw from (after temperature,
top-k/top-p/min-p, penalties and grammar masks), and q the one the draft drew x_i from: the
exactness holds for those two, not for raw logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Verification:
    """What one verify pass emits for one request."""

    #: The tokens to append, in order: `num_accepted` proposals, then one target token.
    token_ids: list[int]
    #: How many proposals were accepted (0..k); len(token_ids) == num_accepted + 1.
    num_accepted: int


def verify_greedy(target_logits: torch.Tensor, proposed_ids: torch.Tensor) -> Verification:
    """Greedy verification.

    Args:
        target_logits: [k + 1, vocab] logits (or probabilities: only the argmax matters; ties go
            to the lowest id, as torch.argmax and the greedy sampler do).
        proposed_ids: [k] proposed token ids, on the same device.
    """
    k = _check(target_logits, proposed_ids)
    argmax = target_logits.argmax(dim=-1)
    # One device-to-host copy for both.
    both = torch.cat([argmax, proposed_ids.to(argmax.dtype)]).tolist()
    target, proposed = both[: k + 1], both[k + 1 :]
    n = 0
    while n < k and proposed[n] == target[n]:
        n += 1
    return Verification(token_ids=target[: n + 1], num_accepted=n)


def verify_sampled(
    target_probs: torch.Tensor,
    proposed_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> Verification:
    """Rejection-sampling verification.

    Args:
        target_probs: [k + 1, vocab] the target's probabilities (rows sum to 1).
        proposed_ids: [k] proposed token ids.
        draft_probs: [k, vocab] the distributions the proposals were drawn from, or None for a
            deterministic proposer (q one-hot at each proposal).
        generator: on target_probs' device; each call draws k uniforms and one vocab-sized
            exponential vector from it, so a seeded generator reproduces the result.
    """
    k = _check(target_probs, proposed_ids)
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{k}, {target_probs.shape[1]}], got {list(draft_probs.shape)}"
        )
    rows = torch.arange(k, device=target_probs.device)
    p_x = target_probs[rows, proposed_ids]
    q_x = None if draft_probs is None else draft_probs[rows, proposed_ids]
    uniform = torch.rand(k, generator=generator, device=target_probs.device, dtype=p_x.dtype)
    accepted = uniform < acceptance_probability(p_x, q_x)
    n = int(accepted.to(torch.int64).cumprod(dim=0).sum())
    if n < k:
        q_row = None if draft_probs is None else draft_probs[n]
        dist = residual_distribution(target_probs[n], q_row, int(proposed_ids[n]))
    else:
        dist = target_probs[k]
    token = _draw(dist, generator)
    return Verification(token_ids=proposed_ids[:n].tolist() + [token], num_accepted=n)


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor | None) -> torch.Tensor:
    """min(1, p(x) / q(x)) per proposal; p(x) when q is one-hot (None). A proposal the draft
    gave probability 0 (it cannot have drawn it, barring rounding) is accepted iff p(x) > 0."""
    if q_x is None:
        return p_x
    ratio = torch.where(q_x > 0, p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny), p_x > 0)
    return ratio.clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, rejected_id: int) -> torch.Tensor:
    """max(0, p - q), unnormalised: what to draw from after rejecting `rejected_id`. With a
    one-hot q that is p with the rejected token zeroed. If it is all zero (p == q up to
    rounding, where a rejection has probability ~0), p itself, so a draw is always defined."""
    if q is None:
        residual = p.clone()
        residual[rejected_id] = 0
    else:
        residual = (p - q).clamp(min=0)
    return residual if bool(residual.sum() > 0) else p


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token with probability proportional to `weights` (the exponential race: argmax of
    w / Exp(1); no normalisation needed, as in the reference sampler)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    # An Exp(1) draw of exactly 0 would make 0 / 0 = nan, which argmax would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return int((weights / noise).argmax())


def _check(target: torch.Tensor, proposed_ids: torch.Tensor) -> int:
    if proposed_ids.dim() != 1 or target.dim() != 2 or target.shape[0] != proposed_ids.shape[0] + 1:
        raise ValueError(
            f"need target [k + 1, vocab] and proposed_ids [k], got {list(target.shape)} and "
            f"{list(proposed_ids.shape)}"
        )
    return int(proposed_ids.shape[0])
