"""FP8 linear layers: e4m3 weights with one float32 scale per output row (per-tensor and
per-channel checkpoints) or per block of `block` rows x columns (fine-grained FP8).

On a GPU that computes in FP8 (compute capability 8.9 and up) the weights stay FP8 and the
products run in Triton (fp8_kernels): one row (batch-1 decode) as W8A16, more rows as W8A8 on
the FP8 tensor cores, the activations scaled per token. Elsewhere the layer dequantizes its
weights for each call, and the loader dequantizes ahead of time where it can (`reader`), so
CPU runs are plain matmuls.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engines.reference.quant import fp8_kernels
from tandem.engines.reference.quant.fp8_format import FP8, dequantize, scale_shape


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether `device` computes FP8 GEMMs (Ada, Hopper and later)."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


class Fp8Linear(nn.Module):
    """y = x @ (weight * scale).T + bias, with `weight` FP8 and `weight_scale` float32.

    Built in place of an nn.Linear of the same features; `bias` keeps the model dtype. The
    loader fills `weight` with the checkpoint's FP8 values and `weight_scale` with its scales
    (a per-tensor scale repeated over the rows it covers, so fused projections of separately
    scaled parts keep every part's scale).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 block: tuple[int, int] | None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.ones(scale_shape(out_features, in_features, block), dtype=torch.float32),
            requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block={self.block}")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if fp8_gemm_supported(x.device) and x.dtype in (torch.bfloat16, torch.float16):
            out = self._forward_fp8(x2.contiguous())
        else:
            out = F.linear(x2, self.dequantized(x.dtype), self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def _forward_fp8(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_kernels.linear(x, self.weight, self.weight_scale, self.block, self.bias)


#: The dense projections of a decoder layer that FP8 checkpoints quantize.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def swap_linears(model: nn.Module, block: tuple[int, int] | None, dtype: torch.dtype,
                 names: tuple[str, ...] = PROJECTIONS) -> int:
    """Replace the dense projections `names` of every layer (nn.Linear children of those
    names; MoE experts are stacked parameters, not these) by Fp8Linear of the same shape, bias
    in `dtype`. Call it on the meta device, after the model's cast to its dtype and before it
    gets storage. Returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in names and type(child) is nn.Linear:
                setattr(module, name, Fp8Linear(child.in_features, child.out_features,
                                                child.bias is not None, block, dtype))
                swapped += 1
    return swapped


def is_fp8_linear(layer: nn.Module) -> bool:
    return isinstance(layer, Fp8Linear)
