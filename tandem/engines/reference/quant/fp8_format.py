"""FP8 (e4m3) weights and activations as tensors: scales, quantizing and dequantizing, in plain
PyTorch (any device)."""
from __future__ import annotations

import torch

from tandem.engines.reference.quant.scheme import FP8_MAX

FP8 = torch.float8_e4m3fn


def scale_shape(out_features: int, in_features: int,
                block: tuple[int, int] | None) -> tuple[int, ...]:
    if block is None:
        return (out_features,)
    return (-(-out_features // block[0]), -(-in_features // block[1]))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """FP8 `weight` [N, K] times its scales (row scales [N], or [N/bn, K/bk] per block) in
    float32, rounded to `dtype` once."""
    w = weight.to(torch.float32)
    if block is None:
        return (w * scale.to(torch.float32).reshape(-1, 1)).to(dtype)
    rows, cols = w.shape
    s = scale.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (w * s[:rows, :cols]).to(dtype)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weight [N, K] and row scales [N] float32 of a float `weight` (per-channel, each row's
    largest magnitude mapped to FP8's)."""
    amax = weight.abs().amax(dim=1).to(torch.float32).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (weight.to(torch.float32) / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations [M, K] and their per-token scales [M, 1] float32 (dynamic)."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
