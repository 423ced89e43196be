"""FP8 checkpoints written from float ones, in the layouts their producers write, so that tests
and benchmarks load quantized checkpoints without downloading any: compressed-tensors
(llm-compressor's `float-quantized`: per tensor, per channel, per block), fine-grained FP8
(`quant_method: fp8`, `weight_scale_inv` per 128x128 block, as Qwen3-FP8 and DeepSeek ship) and
ModelOpt's export (`hf_quant_config.json`, per-tensor `weight_scale` and static `input_scale`).

Quantized are the decoder layers' projections (attention q/k/v/o, the MLP's and every
expert's gate/up/down); embeddings, the LM head, norms and MoE routers stay as they are, as
those tools leave them by default.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil
from typing import Any

import torch

from tandem.engines.reference.quant.scheme import FP8_MAX

FORMATS = ("ct-tensor", "ct-channel", "ct-block", "fp8-block", "modelopt")
_QUANTIZED = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?"
                        r"(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")


def quantize_tensor(weight: torch.Tensor, strategy: str,
                    block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 e4m3 weight, float32 scales) with weight ~= fp8 * scale; scales of shape [1]
    (tensor), [N, 1] (channel) or [ceil(N/bn), ceil(K/bk)] (block)."""
    w = weight.to(torch.float32)
    if strategy == "tensor":
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1)
        expanded = scale.reshape(1, 1)
    elif strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        expanded = scale
    elif strategy == "block":
        rows, cols = w.shape
        bn, bk = block
        padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, device=w.device)
        padded[:rows, :cols] = w.abs()
        tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scale = (tiles.amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        expanded = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    q = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8_checkpoint(src: str | pathlib.Path, dst: str | pathlib.Path, fmt: str,
                         block: tuple[int, int] = (128, 128)) -> pathlib.Path:
    """Write `src` (a float safetensors checkpoint) to `dst` in FP8 format `fmt` (FORMATS);
    config, tokenizer and other files are copied, config.json gains the format's
    quantization_config (ModelOpt: hf_quant_config.json instead)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; known: {', '.join(FORMATS)}")
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    strategy = {"ct-tensor": "tensor", "ct-channel": "channel", "ct-block": "block",
                "fp8-block": "block", "modelopt": "tensor"}[fmt]
    scale_name = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    for path in sorted(src.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = f.get_tensor(name)
                if not _QUANTIZED.search(name):
                    out[name] = tensor
                    continue
                q, scale = quantize_tensor(tensor, strategy, block)
                out[name] = q
                out[name.removesuffix("weight") + scale_name] = scale
                if fmt == "modelopt":
                    out[name.removesuffix("weight") + "input_scale"] = torch.ones(())
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copyfile(path, dst / path.name)
    config = json.loads((src / "config.json").read_text("utf-8"))
    if fmt == "modelopt":
        (dst / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.33.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head"]}}, indent=2))
    else:
        config["quantization_config"] = _quantization_config(fmt, strategy, block)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_mxfp4_checkpoint(src: str | pathlib.Path, dst: str | pathlib.Path) -> pathlib.Path:
    """Write the gpt-oss checkpoint `src` (float, experts stacked as transformers saves them)
    to `dst` as OpenAI ships gpt-oss: each expert projection in MXFP4 (`*_blocks`,
    `*_scales`, stored [E, rows, ...] with rows the output features), the rest as is."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tandem.engines.reference.quant import mxfp4

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = f.get_tensor(name)
                if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                    out[name] = tensor
                    continue
                # held [E, in, out]; stored [E, out, in / 32, 16]
                blocks, scales = mxfp4.quantize(tensor.transpose(1, 2))
                out[name + mxfp4.BLOCKS_SUFFIX] = blocks
                out[name + mxfp4.SCALES_SUFFIX] = scales
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copyfile(path, dst / path.name)
    config = json.loads((src / "config.json").read_text("utf-8"))
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _quantization_config(fmt: str, strategy: str, block: tuple[int, int]) -> dict[str, Any]:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block)}
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": strategy,
                               "symmetric": True, "dynamic": False}
    activations: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True,
                                   "dynamic": True, "strategy": "token"}
    if strategy == "block":
        weights["block_structure"] = list(block)
        activations = {**activations, "strategy": "group", "group_size": block[1]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}
