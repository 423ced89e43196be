"""A checkpoint's FP8 KV-cache scales (`--kv-cache-dtype fp8`), folded into the weights.

Checkpoints calibrated for an FP8 KV cache ship one scale per layer for K and one for V: the
cache holds e4m3(K / k_scale) and attention reads it back times k_scale (compressed-tensors'
`kv_cache_scheme` writes `self_attn.k_scale` / `v_scale`; ModelOpt writes `k_proj.k_scale` /
`v_proj.v_scale`; older exports one `kv_scale` for both). Without them K and V are cast to e4m3
as they are (scale 1.0), which clips anything past +-448.

Rather than divide in every kernel that writes the cache and multiply in every one that reads
it (the CPU's and CUDA's, eager and graphed, decode, prefill and varlen), the scales are folded
into the layer's weights once, while loading: attention is
softmax(q . (k_scale K')) (v_scale V') = v_scale softmax((k_scale q) . K') V' for K' = K / k_scale
and V' = V / v_scale, so the projection writes q times k_scale, K' and V' (the rows of the fused
qkv projection, or of q_norm / k_norm for models that normalise q and k after projecting: the
norm would undo a scaled projection), and o_proj takes the attention's output times v_scale.
gpt-oss's sinks are logits of their own, untouched by q . K. The cache then holds exactly what a
dequantizing kernel's would, and every path reads it unchanged.
"""
from __future__ import annotations

import logging
import pathlib
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.engines.reference.quant.fp8 import Fp8Linear

if TYPE_CHECKING:
    from tandem.engines.reference.attention import Attention
from tandem.errors import InvalidRequest

log = logging.getLogger(__name__)

#: Checkpoint name -> (layer, which): ct `self_attn.k_scale`, ModelOpt `self_attn.k_proj.k_scale`,
#: one `self_attn.kv_scale` for both.
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k_scale|v_scale|kv_scale)$")


def read_kv_scales(files: dict[pathlib.Path, list[str]]) -> dict[int, tuple[float, float]]:
    """(k_scale, v_scale) by layer index, of every layer the checkpoint gives them for.

    Raises:
        InvalidRequest (param "model"): a scale that is not one positive finite number.
    """
    from safetensors import safe_open

    found: dict[int, dict[str, float]] = {}
    for path, names in files.items():
        wanted = [(name, m) for name in names if (m := _NAME.search(name))]
        if not wanted:
            continue
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name, match in wanted:
                tensor = f.get_tensor(name).to(torch.float32)
                value = float(tensor.reshape(-1)[0]) if tensor.numel() == 1 else float("nan")
                if not value > 0 or value == float("inf"):
                    raise InvalidRequest(f"{name}: a KV-cache scale must be one positive "
                                         f"number, got {tensor.tolist()}", param="model")
                layer, which = int(match.group(1)), match.group(2)
                for key in (("k_scale", "v_scale") if which == "kv_scale" else (which,)):
                    found.setdefault(layer, {})[key] = value
    return {layer: (s.get("k_scale", 1.0), s.get("v_scale", 1.0)) for layer, s in found.items()}


def fold_kv_scales(layers: nn.ModuleList, scales: dict[int, tuple[float, float]]) -> None:
    """Folds each layer's (k_scale, v_scale) into its attention's weights (see the module's
    docstring), in place.

    Raises:
        InvalidRequest (param "model"): a scale for a layer the model does not have, or FP8
            block scales that do not align with the q/k/v row ranges.
    """
    for index, (k_scale, v_scale) in sorted(scales.items()):
        if index >= len(layers):
            raise InvalidRequest(f"the checkpoint has KV-cache scales for layer {index}; the "
                                 f"model has {len(layers)} layers", param="model")
        attn: Attention = layers[index].self_attn  # type: ignore[assignment]
        q_rows = (0, attn.q_size)
        k_rows = (attn.q_size, attn.q_size + attn.kv_size)
        v_rows = (attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
        if attn.q_norm is not None and attn.k_norm is not None:  # normalised after projecting
            attn.q_norm.weight.mul_(k_scale)
            attn.k_norm.weight.div_(k_scale)
        else:
            _scale_rows(attn.qkv_proj, q_rows, k_scale)
            _scale_rows(attn.qkv_proj, k_rows, 1 / k_scale)
        _scale_rows(attn.qkv_proj, v_rows, 1 / v_scale)
        # o_proj(v_scale x) = (v_scale W) x + b: every row's weights, not the bias.
        _scale_rows(attn.o_proj, (0, attn.o_proj.out_features), v_scale, bias=False)
    log.info("FP8 KV-cache scales folded into the attention weights",
             extra={"layers": len(scales)})


def _scale_rows(linear: nn.Linear | Fp8Linear, rows: tuple[int, int], factor: float,
                bias: bool = True) -> None:
    """Multiplies output rows [start, stop) of `linear` (weight, and bias with `bias`) by
    `factor`."""
    start, stop = rows
    if bias and linear.bias is not None:
        linear.bias[start:stop].mul_(factor)
    if not isinstance(linear, Fp8Linear):
        linear.weight[start:stop].mul_(factor)
        return
    if linear.block is None:  # one scale per row
        linear.weight_scale[start:stop].mul_(factor)
        return
    rows_per_block = linear.block[0]
    if start % rows_per_block or (stop % rows_per_block and stop != linear.out_features):
        raise InvalidRequest(f"FP8 weight blocks of {rows_per_block} rows do not align with "
                             f"rows {start}-{stop} of the attention projection that a KV-cache "
                             "scale multiplies", param="model")
    linear.weight_scale[start // rows_per_block:-(-stop // rows_per_block)].mul_(factor)
