"""The quantization a checkpoint was saved with, read from its `config.json`
(`quantization_config`) or ModelOpt's `hf_quant_config.json`, as one typed `QuantScheme`.

Formats read (each as its producer writes it):

- compressed-tensors (llm-compressor; `quant_method: compressed-tensors`, format
  `float-quantized` or `naive-quantized`): FP8 e4m3 weights with per-tensor, per-channel or
  block scales in `<linear>.weight_scale`; activations dynamic per token or static per tensor.
- fine-grained FP8 (`quant_method: fp8`, as Qwen3-*-FP8 and DeepSeek ship): FP8 weights with
  `<linear>.weight_scale_inv`, one scale per `weight_block_size` block (or per tensor without
  one). Despite its name the scale multiplies the FP8 values.
- ModelOpt / TensorRT-LLM export (`quant_method: modelopt`, `quant_algo: FP8`): FP8 weights with
  one `<linear>.weight_scale` each, a static `input_scale`, optional `k_scale`/`v_scale`.
- MXFP4 (`quant_method: mxfp4`, gpt-oss): experts as 4-bit blocks of 32 values sharing a
  power-of-two scale (`*_blocks`, `*_scales`), the rest in bfloat16.

Activations are always quantized per token at run time here (dynamic): a static input scale is
read past, since a per-token scale is at least as exact. Integer and 4-bit weight formats other
than MXFP4 are refused by name.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidRequest

#: Largest magnitude of float8_e4m3fn.
FP8_MAX = 448.0
#: Checkpoint tensors beside a quantized weight that carry its scale, by suffix.
WEIGHT_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
#: Scales of other things (static activation scales, KV-cache scales), not weights' params:
#: activations are quantized per token, and KV-cache scales are folded into the attention
#: weights for an FP8 cache (quant.kv_scales).
IGNORED_SCALE_SUFFIXES = (".input_scale", ".activation_scale", ".k_scale", ".v_scale",
                          ".kv_scale", ".input_global_scale", ".weight_zero_point")


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's weights are stored.

    Attributes:
        method: "fp8" (e4m3 weights with scales) or "mxfp4".
        source: the format's name as the checkpoint gives it (compressed-tensors, fp8,
            modelopt, mxfp4, or online for weights quantized while loading).
        block: rows x columns of one weight scale for block FP8; None: one scale per output
            row or per tensor (the reader turns either into one per row).
        ignore: module names or `re:` patterns the producer left unquantized (informational:
            the reader goes by the tensors' dtypes).
    """
    method: str
    source: str
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    @property
    def is_fp8(self) -> bool:
        return self.method == "fp8"


#: `--quantization` values: as the checkpoint says, or FP8 weights made while loading.
QUANTIZATION_CHOICES = ("auto", "fp8")
ONLINE_FP8 = QuantScheme("fp8", "online")


def read_scheme(root: pathlib.Path, config: dict[str, Any],
                requested: str = "auto") -> QuantScheme | None:
    """The checkpoint's scheme (None: not quantized), or ONLINE_FP8 when `requested` is fp8
    and the checkpoint is not quantized already.

    Raises:
        InvalidRequest: a format or variant not read here (named), or an unknown `requested`.
    """
    if requested not in QUANTIZATION_CHOICES:
        raise InvalidRequest(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {requested!r}", param="quantization")
    quant = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config")
    if quant is None and (root / "hf_quant_config.json").is_file():
        exported = json.loads((root / "hf_quant_config.json").read_text("utf-8"))
        quant = {"quant_method": "modelopt", **exported.get("quantization", {})}
    if quant is None:
        return ONLINE_FP8 if requested == "fp8" else None
    method = str(quant.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fine_grained,
               "modelopt": _modelopt, "mxfp4": _mxfp4}
    if method not in readers:
        raise InvalidRequest(f"quantization_config.quant_method {method!r} is not supported; "
                             f"supported: {', '.join(readers)}", param="model")
    scheme = readers[method](quant)
    if requested == "fp8" and not scheme.is_fp8:
        raise InvalidRequest(f"--quantization fp8 asks for FP8 weights, but this checkpoint "
                             f"is {scheme.source}-quantized already", param="quantization")
    return scheme


def _block(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise InvalidRequest(f"{where} must be two positive integers, got {value!r}",
                             param="model")
    return int(value[0]), int(value[1])


def _fine_grained(quant: dict[str, Any]) -> QuantScheme:
    fmt = str(quant.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise InvalidRequest(f"FP8 format {fmt!r} is not supported; supported: e4m3",
                             param="model")
    return QuantScheme("fp8", "fp8", _block(quant.get("weight_block_size"),
                                             "quantization_config.weight_block_size"),
                       tuple(quant.get("modules_to_not_convert") or ()))


def _modelopt(quant: dict[str, Any]) -> QuantScheme:
    algo = str(quant.get("quant_algo", "")).upper()
    if algo != "FP8":
        raise InvalidRequest(f"ModelOpt quant_algo {algo!r} is not supported; supported: FP8",
                             param="model")
    return QuantScheme("fp8", "modelopt", None, tuple(quant.get("exclude_modules") or ()))


def _mxfp4(quant: dict[str, Any]) -> QuantScheme:
    return QuantScheme("mxfp4", "mxfp4", None, tuple(quant.get("modules_to_not_convert") or ()))


def _compressed_tensors(quant: dict[str, Any]) -> QuantScheme:
    fmt = quant.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise InvalidRequest(f"compressed-tensors format {fmt!r} is not supported; supported: "
                             "float-quantized, naive-quantized (FP8 weights)", param="model")
    groups = quant.get("config_groups") or {}
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        kind, bits = weights.get("type"), weights.get("num_bits")
        if kind != "float" or bits != 8:
            raise InvalidRequest(f"compressed-tensors group {name!r} holds {bits}-bit {kind} "
                                 "weights; only 8-bit float (FP8) weights are supported",
                                 param="model")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise InvalidRequest(f"compressed-tensors group {name!r}: weight strategy "
                                 f"{strategy!r} is not supported; supported: tensor, channel, "
                                 "block", param="model")
        blocks.add(_block(weights.get("block_structure"), f"{name}.weights.block_structure")
                   if strategy == "block" else None)
    if not groups:
        raise InvalidRequest("compressed-tensors quantization_config has no config_groups",
                             param="model")
    if len(blocks) > 1:
        raise InvalidRequest("compressed-tensors groups of different block structures are "
                             "not supported", param="model")
    return QuantScheme("fp8", "compressed-tensors", blocks.pop(),
                       tuple(quant.get("ignore") or ()))
