"""Batched token sampling for the reference engine, on CPU and CUDA.

Order of processing for a row (vLLM's): penalties -> min_tokens masking of stop ids -> greedy
argmax (temperature 0) or temperature -> top-k -> top-p -> min-p -> draw. Logprobs come from
log_softmax of the RAW logits, before any of that (vLLM's default `raw_logprobs` mode). A guided
request's grammar mask is applied to the logits before they reach the sampler (as vLLM), so its
logprobs are those of the masked logits.

Seeded draws are a pure function of (seed, len(output_ids)): every sampled row's noise comes
from a 64-bit mix of both (a generator reseeded per row on the CPU, Philox keyed by it in one
kernel on CUDA: `draw_noise`), so a request draws the same token whatever else is in the batch
and however many draws came before (preemption recomputes). Draws use the exponential race
(argmax of probs / Exp(1) noise), always over the vocabulary in id order, so the noise a row sees
does not depend on which filters other rows in the batch asked for.

The only device-to-host transfer per call is one copy of the chosen tokens and logprob values;
`launch` leaves it to the caller (the tokens stay on the device, for a step launched ahead).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engines.reference import draw_noise
from tandem.engines.types import SamplingParams, TokenLogprob, TopLogprob

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True, slots=True)
class SampleInput:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    #: The prompt.
    prompt_ids: Sequence[int]
    #: Tokens generated so far (before this draw).
    output_ids: Sequence[int]
    #: EOS + stop_token_ids that end the request; masked while len(output_ids) < min_tokens.
    stop_ids: frozenset[int]
    #: The request's seed (the engine picks one when params.seed is None).
    seed: int


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_id: int
    #: Present iff params.top_logprobs is not None.
    logprob: TokenLogprob | None


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at output `position` of a request seeded with `seed`."""
    return _mix64((_mix64(seed & _MASK) + (position + 1) * _GOLDEN) & _MASK)


@dataclass(frozen=True, slots=True)
class Draws:
    """A batch's draws, still on the device (Sampler.launch)."""

    #: [N] the chosen token ids.
    tokens: torch.Tensor
    #: What the host needs, in one tensor for one copy: the tokens, then the packed logprobs
    #: of the rows that asked for them (float64 then).
    values: torch.Tensor
    #: Rows that asked for logprobs, and how many alternatives each.
    lp_rows: list[int]
    ks: list[int]


class Sampler:
    """Picks one token per row of a logits batch. Not thread-safe: one engine loop owns it."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        # One generator, reseeded before every row's draw; kernels capture the seed at launch.
        self._generator = torch.Generator(device=self.device)

    def sample(self, logits: torch.Tensor, inputs: Sequence[SampleInput]) -> list[SampleOutput]:
        """Sample the next token of every row.

        Args:
            logits: [N, V] float32 on this sampler's device; row i belongs to inputs[i]. Not
                modified.
            inputs: N rows.
        Returns:
            N outputs, in the order of `inputs`.
        """
        if not inputs:
            return []
        draws = self.launch(logits, inputs)
        return self.collect(draws, draws.values.tolist())

    def launch(self, logits: torch.Tensor, inputs: Sequence[SampleInput],
               noise: torch.Tensor | None = None) -> Draws:
        """`sample` up to the copy to the host: the kernels are queued, nothing waits for the
        device (N >= 1). `noise`: `self.noise(logits, inputs)`, queued earlier."""
        n = len(inputs)
        x = self._apply_penalties(logits, inputs)
        x = self._mask_stops(x, inputs)
        greedy = [i for i, r in enumerate(inputs) if r.params.temperature == 0.0]
        if len(greedy) == n:  # fast path: argmax only
            tokens = x.argmax(dim=-1)
        elif not greedy:
            tokens = self._draw(x, inputs, noise)
        else:
            drawn = [i for i in range(n) if inputs[i].params.temperature != 0.0]
            tokens = torch.empty(n, dtype=torch.long, device=x.device)
            g_idx = self._tensor(greedy, torch.long)
            d_idx = self._tensor(drawn, torch.long)
            tokens[g_idx] = x[g_idx].argmax(dim=-1)
            tokens[d_idx] = self._draw(x[d_idx], [inputs[i] for i in drawn], noise)
        lp_rows = [i for i, r in enumerate(inputs) if r.params.top_logprobs is not None]
        if not lp_rows:
            return Draws(tokens, tokens, [], [])
        ks = [inputs[i].params.top_logprobs or 0 for i in lp_rows]
        if len(lp_rows) == n:
            raw, chosen = logits, tokens
        else:
            idx = self._tensor(lp_rows, torch.long)
            raw, chosen = logits[idx], tokens[idx]
        packed = _pack_logprobs(raw, chosen, max(ks))
        return Draws(tokens, torch.cat([tokens.to(torch.float64), packed]), lp_rows, ks)

    @staticmethod
    def collect(draws: Draws, values: list[float]) -> list[SampleOutput]:
        """The outputs of `draws` from its `values` once on the host (as a list: ints without
        logprobs)."""
        if not draws.lp_rows:
            return [SampleOutput(int(t), None) for t in values]
        n = len(draws.tokens)
        token_ids = [int(t) for t in values[:n]]
        logprobs = _unpack_logprobs(values[n:], token_ids=[token_ids[i] for i in draws.lp_rows],
                                    k=max(draws.ks), ks=draws.ks)
        out = [SampleOutput(t, None) for t in token_ids]
        for i, lp in zip(draws.lp_rows, logprobs):
            out[i] = SampleOutput(token_ids[i], lp)
        return out

    def _tensor(self, values: Sequence[int] | Sequence[float] | torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Host values on this device; on CUDA through pinned memory, so no host sync."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        t = t.to(dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _apply_penalties(self, logits: torch.Tensor,
                         inputs: Sequence[SampleInput]) -> torch.Tensor:
        """Repetition (HF: over prompt + output) then frequency/presence (OpenAI: over output)."""
        n, v = logits.shape
        seen_rows = [i for i, r in enumerate(inputs) if r.params.repetition_penalty != 1.0]
        count_rows = [i for i, r in enumerate(inputs)
                      if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
        if not seen_rows and not count_rows:
            return logits
        x = logits
        if seen_rows:
            flat = [torch.tensor(list(inputs[i].prompt_ids) + list(inputs[i].output_ids),
                                 dtype=torch.long) + i * v for i in seen_rows]
            seen = torch.zeros(n * v, dtype=torch.bool, device=logits.device)
            seen.index_fill_(0, self._tensor(torch.cat(flat), torch.long), True)
            rep = self._tensor([r.params.repetition_penalty for r in inputs], torch.float32)
            rep = rep.unsqueeze(1)
            penalized = torch.where(x > 0, x / rep, x * rep)
            x = torch.where(seen.view(n, v), penalized, x)
        outs = [torch.tensor(list(inputs[i].output_ids), dtype=torch.long) + i * v
                for i in count_rows]
        if outs and sum(len(o) for o in outs):
            idx = self._tensor(torch.cat(outs), torch.long)
            counts = torch.zeros(n * v, dtype=logits.dtype, device=logits.device)
            counts.index_add_(0, idx, torch.ones_like(idx, dtype=logits.dtype))
            counts = counts.view(n, v)
            freq = self._tensor([r.params.frequency_penalty for r in inputs], torch.float32)
            pres = self._tensor([r.params.presence_penalty for r in inputs], torch.float32)
            x = x - (freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(x.dtype))
        return x

    def _mask_stops(self, x: torch.Tensor, inputs: Sequence[SampleInput]) -> torch.Tensor:
        """Stop ids get -inf while a row has fewer than min_tokens outputs, unless the row is
        guided: its grammar allows EOS only once complete, and then nothing else."""
        v = x.shape[1]
        flat = [i * v + t for i, r in enumerate(inputs)
                if len(r.output_ids) < r.params.min_tokens and r.params.guided is None
                for t in r.stop_ids if 0 <= t < v]
        if not flat:
            return x
        # Out of place: x may still be the caller's logits.
        masked = x.reshape(-1).index_fill(0, self._tensor(flat, torch.long), float("-inf"))
        return masked.view_as(x)

    def noise(self, logits: torch.Tensor, inputs: Sequence[SampleInput]) -> torch.Tensor | None:
        """The draws' random part, which the logits' values do not change: one seeded Exp(1)
        row per drawn (temperature > 0) row, queued on the device (on CUDA one kernel for
        the batch, `draw_noise`; elsewhere one generator fill per row). A step that masks its
        logits late (guided decoding) queues it before the mask; None when every row is
        greedy."""
        drawn = [r for r in inputs if r.params.temperature != 0.0]
        if not drawn:
            return None
        # The probabilities' dtype: logits divided by a float32 temperature column.
        dtype = torch.promote_types(logits.dtype, torch.float32)
        noise = torch.empty((len(drawn), logits.shape[-1]), dtype=dtype, device=logits.device)
        seeds = [draw_seed(r.seed, len(r.output_ids)) for r in drawn]
        if draw_noise.serves(noise):  # one kernel for the batch
            return draw_noise.exponential_rows(
                noise, self._tensor([draw_noise.as_int64(s) for s in seeds], torch.int64))
        for i, seed in enumerate(seeds):
            self._generator.manual_seed(seed)
            noise[i].exponential_(generator=self._generator)
        # Exp(1) can be exactly 0 on some backends; 0/0 would be NaN and poison the argmax.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _draw(self, x: torch.Tensor, inputs: Sequence[SampleInput],
              noise: torch.Tensor | None = None) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one seeded draw per row of x ([M, V])."""
        m, v = x.shape
        params = [r.params for r in inputs]
        temp = self._tensor([p.temperature for p in params], torch.float32).unsqueeze(1)
        x = x / temp
        if any(0 < p.top_k < v or p.top_p < 1.0 for p in params):
            x = self._top_k_top_p(x, params)
        probs = torch.softmax(x, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = self._tensor([p.min_p for p in params], torch.float32).unsqueeze(1)
            threshold = min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)  # the race needs no renormalising
        if noise is None:
            noise = self.noise(probs, inputs)
        assert noise is not None
        return (probs / noise).argmax(dim=-1)

    def _top_k_top_p(self, x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """One sort for the batch; masked logits go back to id order (see module docstring)."""
        m, v = x.shape
        # Stable: among equal logits the lowest id ranks first, as in greedy.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(v, device=x.device).unsqueeze(0)
        k = self._tensor([p.top_k if 0 < p.top_k < v else v for p in params], torch.long)
        sorted_x = sorted_x.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = self._tensor([p.top_p for p in params], torch.float32).unsqueeze(1)
            probs = torch.softmax(sorted_x, dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each rank
            # Rank 0 always stays; rows with top_p = 1 stay untouched despite cumsum rounding.
            drop = (before >= top_p) & (top_p < 1.0) & (ranks > 0)
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)


def _pack_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[R] chosen logprobs, then [R, k] top values and [R, k] top ids, flat in float64 (exact
    for ids below 2**53), so one copy brings everything to the host."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    parts = [chosen.to(torch.float64)]
    if k > 0:
        top = lp.topk(k, dim=-1)  # sorted, best first
        parts += [top.values.to(torch.float64).flatten(), top.indices.to(torch.float64).flatten()]
    return torch.cat(parts)


def _unpack_logprobs(values: list[float], token_ids: list[int], k: int,
                     ks: list[int]) -> list[TokenLogprob]:
    """Inverse of _pack_logprobs; row r keeps its first ks[r] of the k alternatives."""
    r = len(token_ids)
    out = []
    for row, (token_id, kr) in enumerate(zip(token_ids, ks)):
        vals = values[r + row * k: r + row * k + kr]
        ids = values[r + r * k + row * k: r + r * k + row * k + kr]
        top = tuple(TopLogprob(int(t), v) for t, v in zip(ids, vals))
        out.append(TokenLogprob(token_id, values[row], top))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int],
                    k: int) -> list[TokenLogprob]:
    """Logprobs of the prompt's own tokens under the model.

    Args:
        logits: [L-1, V] for prompt positions 0..L-2, row j predicting prompt_ids[j + 1].
        prompt_ids: the L prompt tokens.
        k: alternatives per position (0: the actual token only).
    Returns:
        L-1 TokenLogprobs (one per prompt token after the first), each with the actual token's
        logprob and the k most likely alternatives, best first.
    """
    targets = list(prompt_ids[1:])
    if logits.shape[0] != len(targets):
        raise ValueError(f"prompt_logprobs: {logits.shape[0]} logits rows for "
                         f"{len(targets)} predicted prompt tokens")
    if not targets:
        return []
    ids = torch.tensor(targets, dtype=torch.long).to(logits.device, non_blocking=True)
    values = _pack_logprobs(logits, ids, k).tolist()
    return _unpack_logprobs(values, token_ids=targets, k=k, ks=[k] * len(targets))
