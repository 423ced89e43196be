"""The position-wise blocks of a Llama/Qwen decoder layer: RMSNorm and the SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim.

    The normalisation runs in float32 and is cast back before the weight multiply, in the same
    order as transformers, so bf16/fp16 outputs round identically to the reference.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    `gate_up_proj.weight` is [2 * intermediate, hidden]: rows [0, I) are HF's gate_proj, rows
    [I, 2I) its up_proj (the loader writes them there).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
