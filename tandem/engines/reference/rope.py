"""Rotary position embedding in the "rotate half" (GPT-NeoX) layout used by HF Llama and Qwen.

A head vector x = [x1 | x2] (halves of head_size) at position p becomes
    [x1 * cos - x2 * sin | x2 * cos + x1 * sin],   angle = p * inv_freq[i].
cos/sin are precomputed in float32 for every position up to max_position_embeddings and gathered
by a positions tensor, so a step needs no per-position work on the host. YaRN (gpt-oss) also
scales cos and sin by its attention factor, which scales q.k by its square.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tandem.errors import InvalidRequest

#: rope_type values this module implements ("default" means no scaling dict at all).
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
_REQUIRED_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def check_scaling(scaling: Mapping[str, Any] | None) -> None:
    """Raise InvalidRequest (param="model") unless `scaling` is None or a complete supported one."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise InvalidRequest(f"unsupported rope_type {rope_type!r}; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}", param="model")
    missing = [key for key in _REQUIRED_KEYS.get(rope_type, ()) if scaling.get(key) is None]
    if missing:
        raise InvalidRequest(f"{rope_type} rope_scaling lacks {', '.join(missing)}", param="model")


def inverse_frequencies(head_size: int, theta: float,
                        scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """[head_size // 2] float32 inverse frequencies, scaled as `scaling` says.

    Computed exactly as transformers does (int64 arange cast to float32) so tables match bitwise.
    """
    check_scaling(scaling)
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    pos_freqs = theta ** exponents
    inv_freq = 1.0 / pos_freqs
    if scaling is None or scaling["rope_type"] == "default":
        return inv_freq
    if scaling["rope_type"] == "yarn":
        return _yarn_scale(pos_freqs, head_size, theta, scaling)
    return _llama3_scale(inv_freq, scaling)


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by: 1 except for YaRN, whose default is
    0.1 * ln(factor) + 1 (or a ratio of such terms when `mscale` and `mscale_all_dim` are set),
    as transformers computes it."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _yarn_scale(pos_freqs: torch.Tensor, head_size: int, theta: float,
                scaling: Mapping[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the frequencies that rotate fewer than `beta_slow`
    times over the original context, keep those that rotate more than `beta_fast` times, and
    ramp linearly between; same operations and order as transformers' `_compute_yarn_parameters`.
    `pos_freqs` is theta ** (2i / head_size), the reciprocal of the unscaled frequencies.
    """
    factor = float(scaling["factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_size * math.log(old_context / (num_rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = (torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation = 1 - torch.clamp(ramp, 0, 1)
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _llama3_scale(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band between."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of one model; `forward(positions)` gathers the rows a step needs.

    The table is a non-persistent float32 buffer [max_positions, head_size] ([cos | sin] halves).
    After building the module on the meta device, call `reset_cache()` once it has a real device.
    """

    def __init__(self, head_size: int, max_positions: int, theta: float,
                 scaling: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = dict(scaling) if scaling is not None else None
        check_scaling(self.scaling)
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", torch.empty(max_positions, head_size), persistent=False)
        if self.cos_sin.device.type != "meta":
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the cos/sin table in float32 on the buffer's current device."""
        device = self.cos_sin.device
        inv_freq = inverse_frequencies(self.head_size, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        scale = attention_factor(self.scaling)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos_sin = torch.cat([cos, sin], dim=-1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each float32 [T, 1, head_size // 2], for `apply_rope`. Positions must be
        < max_positions; not checked here because that would be a host sync (the engine bounds
        requests by the model length instead)."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        return cos[:, None, :], sin[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_size] by the (cos, sin) of `RotaryEmbedding.forward`."""
    # Cast the table to x's dtype before multiplying, as transformers does, so half-precision
    # results match the reference rather than being more precise than it.
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
