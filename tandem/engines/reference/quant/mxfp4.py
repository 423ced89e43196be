"""MXFP4 (the OCP microscaling format gpt-oss ships its experts in): 4-bit e2m1 values, two per
byte (low nibble first), in blocks of 32 that share one e8m0 scale (a power of two, biased by
127). A projection [rows, cols] is stored as `<name>_blocks` uint8 [..., rows, cols / 32, 16]
and `<name>_scales` uint8 [..., rows, cols / 32]; gpt-oss's model holds each expert
projection transposed ([cols, rows]: input first), as transformers does.

The experts are dequantized while loading (to the model dtype, exactly: every e2m1 value times
a power of two is a bf16 value); a W4A16 kernel that keeps them 4-bit is not built yet.
"""
from __future__ import annotations

import torch

from tandem.errors import InvalidRequest

#: The e2m1 values of the 16 nibbles.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """float32 [..., cols, rows] (transposed, as gpt-oss's experts are held) of the MXFP4
    projection `name` stored as `blocks` [..., rows, cols / 32, 16] and `scales`
    [..., rows, cols / 32]."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise InvalidRequest(f"{name}: MXFP4 blocks of shape {tuple(blocks.shape)} "
                             f"({blocks.dtype}) and scales of shape {tuple(scales.shape)} do "
                             "not match ([..., rows, cols/32, 16] uint8 and [..., rows, "
                             "cols/32])", param="model")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.reshape(*blocks.shape[:-1], BLOCK)  # [..., rows, groups, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1))
    return values.reshape(*scales.shape[:-1], -1).transpose(-1, -2)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a float projection [..., rows, cols] (cols a multiple of 32): each
    group's scale the smallest power of two that fits its largest magnitude in e2m1's 6, each
    value rounded to the nearest e2m1 value (ties to the first)."""
    *lead, rows, cols = weight.shape
    groups = weight.to(torch.float32).reshape(*lead, rows, cols // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)
    pairs = codes.reshape(*lead, rows, cols // BLOCK, BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponents + 127).to(torch.uint8)
