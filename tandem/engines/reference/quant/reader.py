"""Quantized checkpoint tensors into a model's parameters, for the loader.

An FP8 weight goes into an Fp8Linear as it is, its scale into the rows of `weight_scale` that
its part of a fused projection covers (a per-tensor scale repeated over them); into a float
parameter (the CPU, MoE experts) it goes dequantized. A float weight bound for an Fp8Linear
(`--quantization fp8`) is quantized per row on the way in. MXFP4 experts are dequantized
(quant.mxfp4).
"""
from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterable

import torch

from tandem.engines.reference.quant import mxfp4
from tandem.engines.reference.quant.fp8_format import FP8, dequantize, quantize_rows
from tandem.engines.reference.quant.scheme import (
    IGNORED_SCALE_SUFFIXES,
    WEIGHT_SCALE_SUFFIXES,
    QuantScheme,
)
from tandem.errors import InvalidRequest

#: Every suffix of a scale tensor the loader must not look for a parameter of.
SCALE_SUFFIXES = WEIGHT_SCALE_SUFFIXES + IGNORED_SCALE_SUFFIXES


_MXFP4_SCALES = "_proj" + mxfp4.SCALES_SUFFIX


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES) or name.endswith(_MXFP4_SCALES)


def weight_of_scale(name: str) -> str | None:
    """The tensor a scale belongs to: `x.weight_scale` or `x.weight_scale_inv` -> `x.weight`,
    MXFP4's `x_proj_scales` -> `x_proj`; None for other names."""
    for suffix in WEIGHT_SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    if name.endswith(_MXFP4_SCALES):
        return name.removesuffix(mxfp4.SCALES_SUFFIX)
    return None


def without_blocks(rename: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """`rename`, then MXFP4's `x_proj_blocks` -> `x_proj` (the parameter it dequantizes to)."""
    def name(checkpoint_name: str) -> str | None:
        result = rename(checkpoint_name)
        if result is not None and result.endswith("_proj" + mxfp4.BLOCKS_SUFFIX):
            return result.removesuffix(mxfp4.BLOCKS_SUFFIX)
        return result
    return name


class QuantReader:
    """Holds every weight scale of a checkpoint (they are small) and writes weights with them.

    Args:
        scheme: the checkpoint's scheme.
        scales: (canonical name, tensor) of every scale tensor, from all checkpoint files
            (a weight and its scale may sit in different shards).
    """

    def __init__(self, scheme: QuantScheme, scales: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.scheme = scheme
        self.scales: dict[str, torch.Tensor] = {}
        for name, tensor in scales:
            weight = weight_of_scale(name)
            if weight is not None:  # MXFP4's stay uint8 (exponents)
                self.scales[weight] = (tensor if tensor.dtype == torch.uint8
                                       else tensor.to(torch.float32))

    def prepare(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor `name` in the shape of its parameter: MXFP4 blocks dequantized (float32,
        transposed as the model holds experts), anything else as it is."""
        if self.scheme.method == "mxfp4" and tensor.dtype == torch.uint8:
            scales = self.scales.get(name)
            if scales is None:
                raise InvalidRequest(f"checkpoint tensor {name}_blocks has no {name}_scales "
                                     "beside it", param="model")
            return mxfp4.dequantize(tensor, scales.to(torch.uint8), name)
        return tensor

    def dequantized(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """FP8 checkpoint tensor `name` as float32 (its scales applied)."""
        return dequantize(tensor, self._scale(name, tensor.shape), self.scheme.block,
                          torch.float32)

    def shard_scale(self, name: str, full: torch.Size, part: torch.Size,
                    cut: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The scales of a tensor-parallel rank's `part` of FP8 weight `name` (whole shape
        `full`), which `cut` made of the whole: cut as the weight's rows (column-parallel) or
        columns (row-parallel) were, in the shapes `write` takes.

        Raises:
            InvalidRequest (param "tensor_parallel_size"): block scales the cut splits.
        """
        scale = self._scale(name, full)
        rows_cut = part[0] != full[0]  # else the columns were cut (row-parallel)
        block = self.scheme.block
        if block is None or scale.dim() == 1:  # one scale per row
            return cut(scale) if rows_cut else scale
        # Block scales: spread over the weight's rows (or columns), cut as the weight, and
        # taken back one per block, where the cut falls on block edges.
        dim, size = (0, block[0]) if rows_cut else (1, block[1])
        spread = scale.repeat_interleave(size, dim).narrow(dim, 0, full[dim])
        piece = cut(spread)
        if piece.shape[dim] % size:
            raise InvalidRequest(f"{name}: a rank's {piece.shape[dim]} "
                                 f"{'rows' if rows_cut else 'columns'} split the checkpoint's "
                                 f"{block[0]}x{block[1]} FP8 scale blocks; serve it at a "
                                 "tensor-parallel size that keeps whole blocks",
                                 param="tensor_parallel_size")
        return piece[::size] if rows_cut else piece[:, ::size]

    def write(self, name: str, tensor: torch.Tensor, dest: torch.Tensor,
              scale_dest: Callable[[int], torch.Tensor] | None, start: int,
              scale: torch.Tensor | None = None) -> None:
        """Copy checkpoint tensor `name` into `dest` (rows [start, start + len) of its
        parameter); `scale_dest(row_divisor)` gives the parameter's matching scale rows when
        the parameter is FP8 (Fp8Linear), None otherwise. `scale`: an FP8 tensor's scales
        when it is a rank's part (`shard_scale`); None: the checkpoint's own."""
        if dest.dtype == FP8:
            assert scale_dest is not None
            if tensor.dtype == FP8:
                self._write_fp8(name, tensor, dest, scale_dest, start, scale)
            else:  # online quantization of a float checkpoint
                q, row_scales = quantize_rows(tensor.to(torch.float32))
                dest.copy_(q)
                scale_dest(1).copy_(row_scales)
            return
        if tensor.dtype == FP8:
            tensor = self.dequantized(name, tensor)
        dest.copy_(tensor)

    def _write_fp8(self, name: str, tensor: torch.Tensor, dest: torch.Tensor,
                   scale_dest: Callable[[int], torch.Tensor], start: int,
                   scale: torch.Tensor | None) -> None:
        scale = self._scale(name, tensor.shape) if scale is None else scale
        dest.copy_(tensor)
        block = self.scheme.block
        if block is None:
            scale_dest(1).copy_(scale.reshape(-1))
            return
        rows = tensor.shape[0]
        if start % block[0] or rows % block[0]:
            raise InvalidRequest(f"{name}: {rows} rows at row {start} of a fused projection do "
                                 f"not align with the {block[0]}-row scale blocks",
                                 param="model")
        scale_dest(block[0]).copy_(scale)

    def _scale(self, name: str, shape: torch.Size) -> torch.Tensor:
        """The scale of `name` (of `shape`): a scalar or one per row becomes one per row
        ([N]); block scales keep their [N/bn, K/bk] shape."""
        scale = self.scales.get(name)
        if scale is None:
            raise InvalidRequest(f"checkpoint tensor {name} is FP8 but has no weight_scale "
                                 "(or weight_scale_inv) beside it", param="model")
        rows, cols = shape
        block = self.scheme.block
        if block is not None and scale.numel() > 1:
            expected = (-(-rows // block[0]), -(-cols // block[1]))
            if tuple(scale.shape) != expected:
                raise InvalidRequest(f"{name}: block scales of shape {tuple(scale.shape)}, "
                                     f"expected {expected} for blocks of {block}",
                                     param="model")
            return scale
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(rows)
        elif scale.numel() != rows:
            raise InvalidRequest(f"{name}: {scale.numel()} scales for {rows} rows (expected one "
                                 "per tensor or per row)", param="model")
        if block is not None:  # a per-tensor scale in a block checkpoint: as blocks
            n_blocks = -(-rows // block[0]), -(-cols // block[1])
            return scale.reshape(-1)[:: block[0]][: n_blocks[0], None].expand(n_blocks).clone()
        return scale.reshape(-1)


def read_scales(files: dict[pathlib.Path, list[str]], rename: Callable[[str], str | None],
                device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) of every weight-scale tensor of the checkpoint."""
    from safetensors import safe_open

    found = []
    for path, names in files.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                canonical = rename(name)
                if canonical is not None and weight_of_scale(canonical) is not None:
                    found.append((canonical, f.get_tensor(name).to(device)))
    return found
