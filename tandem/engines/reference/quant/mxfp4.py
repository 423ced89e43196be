"""MXFP4 (the OCP microscaling format gpt-oss ships its experts in): 4-bit e2m1 values, two per
byte (low nibble first), in blocks of 32 that share one e8m0 scale (a power of two, biased by
127). A projection [rows, cols] is stored as `<name>_blocks` uint8 [..., rows, cols / 32, 16]
and `<name>_scales` uint8 [..., rows, cols / 32]; gpt-oss's model holds each expert
projection transposed ([cols, rows]: input first), as transformers does.

On CUDA in half precision the experts stay packed as the checkpoint ships them
(`PackedExperts`, swapped in by `moe.pack_experts`; the layout is already what the kernel reads
best: each output row's 4-bit values contiguous along the input dimension) and run through the
W4A16 grouped GEMM of moe_kernels, which dequantizes tiles in registers. Elsewhere (the CPU,
float32) they are dequantized while loading (to the model dtype, exactly: every e2m1 value
times a power of two is a bf16 value).
"""
from __future__ import annotations

import math

import torch
from torch import nn

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


#: Root mean square of the 16 e2m1 values (drawn uniformly), for dummy weights.
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1) / len(E2M1))


class PackedExperts(nn.Module):
    """gpt-oss's E experts as the checkpoint ships them (parameter names included, so that
    the files load as they are): `gate_up_proj_blocks` uint8 [E, 2I, H / 32, 16] and
    `gate_up_proj_scales` uint8 [E, 2I, H / 32] (rows: the output features, gate and up
    interleaved as in moe.BiasedExperts), `down_proj_blocks` [E, H, I / 32, 16] and
    `down_proj_scales` [E, H, I / 32]; the biases in the model dtype, as moe.BiasedExperts'."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        for name, size in (("hidden_size", hidden_size),
                           ("intermediate_size", intermediate_size)):
            if size % BLOCK:
                raise InvalidRequest(f"MXFP4 experts need a {name} that is a multiple of "
                                     f"{BLOCK}, got {size}", param="model")
        width = 2 * intermediate_size

        def packed(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)
        self.gate_up_proj_blocks = packed(num_experts, width, hidden_size // BLOCK, BLOCK // 2)
        self.gate_up_proj_scales = packed(num_experts, width, hidden_size // BLOCK)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, width))
        self.down_proj_blocks = packed(num_experts, hidden_size, intermediate_size // BLOCK,
                                       BLOCK // 2)
        self.down_proj_scales = packed(num_experts, hidden_size, intermediate_size // BLOCK)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, H, 2I], down [E, I, H]) in float32, moe.BiasedExperts' layout (tests
        and references)."""
        return (dequantize(self.gate_up_proj_blocks, self.gate_up_proj_scales, "gate_up_proj"),
                dequantize(self.down_proj_blocks, self.down_proj_scales, "down_proj"))


def draw_packed(param: torch.Tensor, name: str, std: float,
                generator: torch.Generator) -> None:
    """Dummy MXFP4 weights of about `std` standard deviation: uniform random codes (blocks),
    scales of 2^round(log2(std / E2M1_RMS))."""
    if name.endswith(SCALES_SUFFIX):
        param.fill_(127 + round(math.log2(std / E2M1_RMS)))
    else:
        param.random_(0, 256, generator=generator)
