"""The mock engine's timing model: the polynomial perf model of Dynamo 1.6.1's mocker.

Dynamo 1.6.1 runs its mocker on the aisimulate-core 0.13.0 crate (the path its `_core` extension
was built from), driven in real time by `lib/mocker/src/generalized_live.rs`. One engine pass
(`scheduler/vllm/core.rs`, `execute_pass_internal`) lasts

    prefill_ms(T) + decode_ms(u)        (`engine/common/perf_model.rs`)

- T: the new (uncached) prompt tokens the pass computes, summed over every request prefilling in
  it (the square is of that batch total); 0 ms when none prefills. Chunked prefill charges each
  chunk its own tokens.
- decode_ms is charged only when some request in the pass decodes, i.e. emits a token after its
  first: a request whose prefill completes in the pass emits its first token at the end of the
  pass without a decode charge (at concurrency 1, TTFT is prefill_ms(ISL) alone).
- u ("active_perc"): the tokens of the decoding requests' sequences (prompt plus output so far),
  summed, over the pool's token capacity (blocks x block size), capped at 1.

Both terms are divided by the speedup ratio (decode also by Dynamo's decode_speedup_ratio, 1 by
default). The pass's sleep aims at a deadline from the pass's start (`sleep_until_precise`), so
scheduling work inside the pass is absorbed. One difference is deliberate: Tandem's speedup
ratio 0 means no delay at all (DESIGN), where Dynamo 1.6.1 takes 0 as "unscaled" (real time);
`../shared/peers/side_by_side.py` passes Dynamo 1000 for Tandem's 0.
"""
from __future__ import annotations

#: prefill_ms = A*T^2 + B*T + C
PREFILL_A = 4.209989e-7
PREFILL_B = 1.518344e-2
PREFILL_C = 16.50142
#: decode_ms = max(1, D*u^2 + E*u + F)
DECODE_D = -25.74
DECODE_E = 54.01
DECODE_F = 5.74
DECODE_FLOOR_MS = 1.0
#: Speedup ratios at or above this (or 0) mean "do not sleep at all".
NO_DELAY_RATIO = 1e6


def prefill_ms(num_tokens: int) -> float:
    """Simulated prefill time of a pass computing `num_tokens` new prompt tokens (0 -> 0 ms)."""
    if num_tokens <= 0:
        return 0.0
    t = float(num_tokens)
    return PREFILL_A * t * t + PREFILL_B * t + PREFILL_C


def decode_ms(utilization: float) -> float:
    """Simulated decode time of a pass at KV utilisation `utilization` (0..1), >= 1 ms."""
    u = utilization
    return max(DECODE_FLOOR_MS, DECODE_D * u * u + DECODE_E * u + DECODE_F)


def is_no_delay(speedup_ratio: float) -> bool:
    return speedup_ratio <= 0 or speedup_ratio >= NO_DELAY_RATIO


def step_seconds(prefill_tokens: int, decode_tokens: int | None, capacity_tokens: int,
                 speedup_ratio: float) -> float:
    """Wall time one pass should take: (prefill + decode) / speedup, 0 when there is no delay.

    Args:
        prefill_tokens: new prompt tokens computed in the pass (T).
        decode_tokens: the sequence lengths of the requests decoding in the pass, summed; None
            when none decodes (no decode charge).
        capacity_tokens: the KV pool's capacity in tokens (u = decode_tokens / capacity).
    """
    if is_no_delay(speedup_ratio):
        return 0.0
    ms = prefill_ms(prefill_tokens)
    if decode_tokens is not None:
        ms += decode_ms(min(decode_tokens / capacity_tokens, 1.0) if capacity_tokens else 1.0)
    return ms / speedup_ratio / 1000.0
