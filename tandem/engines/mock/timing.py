"""The mock engine's timing model, Dynamo mocker's polynomial perf model.

Dynamo (lib/mocker, vLLM-style scheduler) times one engine pass as
    prefill_ms(T) + decode_ms(u)
where T is the number of uncached prompt tokens computed in the pass, summed over every request
prefilling in it (0 ms when there are none), and decode_ms is charged once when at least one
request emits a token at the end of the pass (requests finishing their prefill in the pass
included); u is the share of KV blocks in use. Prefill is divided by the speedup ratio, decode by
the speedup ratio too (Dynamo also multiplies in a decode-only ratio, 1 by default).
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


def step_seconds(prefill_tokens: int, emits_tokens: bool, utilization: float,
                 speedup_ratio: float) -> float:
    """Wall time one pass should take: (prefill + decode) / speedup, 0 when there is no delay."""
    if is_no_delay(speedup_ratio):
        return 0.0
    ms = prefill_ms(prefill_tokens) + (decode_ms(utilization) if emits_tokens else 0.0)
    return ms / speedup_ratio / 1000.0
