"""Build a DecoderModel on its device and fill it from safetensors (or with dummy weights).

The module tree is built on the meta device and then given uninitialised storage on the target
device (`to_empty`), so no tensor is ever materialised twice and nothing big passes through CPU
memory. Checkpoint names are translated to module parameters by one table derived from the model
itself (`_parameter_map`), which also gives the missing/unexpected checks for free.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from tandem.engines.reference import kernels
from tandem.engines.reference.checkpoint_names import (
    base_name,
    is_unused,
    same_name,
    text_name,
    then_mixtral_name,
    vision_name,
)
from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.moe import pack_experts
from tandem.engines.reference.parallel import shard
from tandem.engines.reference.parallel.group import TensorGroup
from tandem.engines.reference.quant.fp8 import fp8_gemm_supported, swap_linears
from tandem.engines.reference.quant.fp8_format import FP8, quantize_rows
from tandem.engines.reference.quant.kv_scales import fold_kv_scales, read_kv_scales
from tandem.engines.reference.quant.mxfp4 import draw_packed
from tandem.engines.reference.quant.reader import (
    QuantReader,
    is_scale,
    read_scales,
    without_blocks,
)
from tandem.engines.reference.quant.scheme import read_scheme
from tandem.engines.reference.spec import ModelSpec
from tandem.engines.reference.vision import LlavaVision, VisionSpec
from tandem.errors import InvalidRequest

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Standard deviation of dummy weights: small enough that activations stay finite in bf16.
DUMMY_STD = 0.02
_INDEX_FILE = "model.safetensors.index.json"
# Checkpoint projections that land in a row range of one fused parameter, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Buffers some older checkpoints saved; recomputed here, so skipped silently.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class Target(NamedTuple):
    """Where one checkpoint tensor goes: rows [start, start + rows) of parameter `name`, or of
    its slice `expert` when the parameter stacks experts."""
    name: str
    start: int
    rows: int
    expert: int | None = None


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype | None, device: torch.device,
               load_format: str = "auto", seed: int = 0,
               tp: TensorGroup | None = None, quantization: str = "auto",
               fp8_layers: bool | None = None,
               kv_scales: bool = False) -> tuple[DecoderModel, ModelSpec]:
    """Build the model described by `model_dir/config.json` on `device`, in eval mode, no grad;
    with `tp` of more than one rank, this rank's shard (parallel.shard).

    Args:
        dtype: parameter dtype; None means the config's torch_dtype.
        load_format: "auto"/"safetensors" read *.safetensors (one file or an index of shards);
            "dummy" reads config.json only and draws N(0, DUMMY_STD) weights (norms = 1) from
            `seed`, for performance work on checkpoints that are not present.
        quantization: "auto" reads the checkpoint as its quantization_config says (quant.
            scheme); "fp8" also quantizes a float checkpoint's dense projections to FP8 rows.
        fp8_layers: keep FP8 weights as FP8 (quant.fp8.Fp8Linear); None: where the device
            computes FP8 GEMMs. Otherwise FP8 weights are dequantized to `dtype` while loading.
        kv_scales: fold the checkpoint's FP8 KV-cache scales, if it has any, into the
            attention weights (quant.kv_scales; for `--kv-cache-dtype fp8`).
    Returns:
        (model, spec); spec.dtype is the dtype actually used, and spec.tie_word_embeddings is
        True when the checkpoint has no lm_head (the embedding is then reused, as HF does).
        Under tensor parallelism spec is this rank's shape (shard.local_spec).
    Raises:
        InvalidRequest: unsupported model/dtype/load_format, no weight files, checkpoint
            tensors that are missing, unexpected or of the wrong shape (named in the message),
            or a model that `tp`'s rank count does not divide.
    """
    if load_format not in LOAD_FORMATS:
        raise InvalidRequest(f"unsupported load_format {load_format!r}; supported: "
                             f"{', '.join(LOAD_FORMATS)}", param="load_format")
    root = pathlib.Path(model_dir)
    spec = ModelSpec.from_dir(root)
    dtype = dtype or spec.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidRequest(f"unsupported dtype {dtype}; supported: float32, float16, bfloat16",
                             param="dtype")
    spec = dataclasses.replace(spec, dtype=dtype)
    scheme = read_scheme(root, _read_config(root), quantization)
    files: dict[pathlib.Path, list[str]] = {}
    rename: Callable[[str], str | None] = (text_name if spec.wrapper else base_name
                                           if spec.base_model else same_name)
    if spec.family == "mixtral":
        rename = then_mixtral_name(rename)
    # MXFP4 experts stay packed where the W4A16 kernel runs (CUDA, half precision); elsewhere
    # the reader dequantizes them into the float experts.
    packed = (scheme is not None and scheme.method == "mxfp4" and spec.moe_kind == "gpt_oss"
              and kernels.serves(device, dtype))
    if scheme is not None and scheme.method == "mxfp4" and not packed:
        rename = without_blocks(rename)
    names: set[str | None] = set()
    if load_format != "dummy":
        files = checkpoint_index(root)
        names = {rename(name) for file_names in files.values() for name in file_names}
        if not spec.tie_word_embeddings and "lm_head.weight" not in names:
            logger.info("%s has no lm_head.weight: tying it to the input embedding", root)
            spec = dataclasses.replace(spec, tie_word_embeddings=True)

    tp = tp or TensorGroup()
    if scheme is not None and not scheme.is_fp8 and tp.size > 1:
        raise InvalidRequest(f"{scheme.method.upper()} weights are not cut across ranks yet; "
                             "serve this checkpoint at --tensor-parallel-size 1",
                             param="tensor_parallel_size")
    shard.check(spec, tp.size)
    shards = shard.Shards(spec, tp.rank, tp.size)
    whole = spec
    spec = shard.local_spec(spec, tp.size)
    with torch.device("meta"):
        model = DecoderModel(spec, tp, whole.vocab_size)
        if packed:
            pack_experts(model)
    model = model.to(dtype)  # floating-point parameters only: packed experts stay uint8
    fp8 = scheme is not None and scheme.is_fp8 and (
        fp8_gemm_supported(device) if fp8_layers is None else fp8_layers)
    if fp8:
        with torch.device("meta"):
            swap_linears(model, scheme.block if scheme else None, dtype)
    elif scheme is not None and scheme.source == "online":
        logger.warning("--quantization fp8: %s computes no FP8 GEMMs; the weights stay %s",
                       device, dtype)
    model = model.to_empty(device=device)
    model.rotary_emb.reset_cache()  # the table is computed, never loaded
    model.eval().requires_grad_(False)

    if load_format == "dummy":
        init_dummy(model, seed)
    else:
        ignored = {"lm_head.weight"} if spec.tie_word_embeddings else set()  # tied: a copy
        # transformers 5 keeps experts stacked in memory; a checkpoint saved that way holds
        # `experts.gate_up_proj` itself, the usual one a tensor per expert and projection.
        # gpt-oss has only the stacked layout (its MXFP4 originals are refused here).
        stacked = spec.moe_kind == "gpt_oss" or any(
            n is not None and n.endswith(".experts.gate_up_proj") for n in names)
        if spec.moe_kind == "gpt_oss" and (scheme is None or scheme.method != "mxfp4"):
            _refuse_mxfp4(names)
        reader = (QuantReader(scheme, read_scales(files, rename, device))
                  if scheme and not packed else None)  # packed: every tensor loads as it is
        load_safetensors(model, _parameter_map(model, stacked), files, device, rename, ignored,
                         spec.architecture, shards.cut, reader)
        if kv_scales and (found := read_kv_scales(files)):
            fold_kv_scales(model.layers, found)
    return model, spec


def _refuse_mxfp4(names: set[str | None]) -> None:
    """MXFP4 experts (`*_blocks`, `*_scales`) in a checkpoint whose config.json does not say
    so (gpt-oss as OpenAI ships it has `quantization_config: {quant_method: mxfp4}`)."""
    if any(n is not None and n.endswith(("_proj_blocks", "_proj_scales")) for n in names):
        raise InvalidRequest("this gpt-oss checkpoint holds MXFP4-quantized experts "
                             "(`*_blocks`/`*_scales`) but its config.json has no "
                             "quantization_config with quant_method mxfp4; add it as the "
                             "published checkpoint has it", param="model")


def load_vision(model_dir: str | pathlib.Path, dtype: torch.dtype, device: torch.device,
                load_format: str = "auto", seed: int = 0) -> LlavaVision | None:
    """The vision tower and projector of a LLaVA checkpoint (eval mode, no grad), or None for a
    text-only model. Raises InvalidRequest as `load_model` does."""
    root = pathlib.Path(model_dir)
    spec = VisionSpec.from_config(_read_config(root))
    if spec is None:
        return None
    with torch.device("meta"):
        vision = LlavaVision(spec)
    vision = vision.to(dtype).to_empty(device=device)
    vision.eval().requires_grad_(False)
    if load_format == "dummy":
        init_dummy(vision, seed)
        return vision
    targets = {name: Target(name, 0, param.shape[0])
               for name, param in vision.named_parameters()}
    files = checkpoint_index(root)
    names = {vision_name(n) for file_names in files.values() for n in file_names}
    ignored = {name for name in names if name is not None and is_unused(name, spec.num_layers)}
    load_safetensors(vision, targets, files, device, vision_name, ignored,
                     "a LLaVA vision tower and projector")
    return vision


def _read_config(root: pathlib.Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((root / "config.json").read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read {root / 'config.json'}: {exc}",
                             param="model") from exc
    return config


def checkpoint_index(root: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """{file: tensor names}, from the shard index if there is one, else from file headers."""
    index_path = root / _INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text("utf-8"))["weight_map"]
        files: dict[pathlib.Path, list[str]] = {}
        for name, file_name in weight_map.items():
            files.setdefault(root / file_name, []).append(name)
        return files
    paths = sorted(root.glob("*.safetensors"))
    if not paths:
        raise InvalidRequest(f"no *.safetensors weights in {root} (other formats are not "
                             "supported; load_format='dummy' needs only config.json)",
                             param="model")
    from safetensors import safe_open

    result = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:  # reads the header only
            result[path] = list(f.keys())
    return result


def _parameter_map(model: DecoderModel, stacked_experts: bool = False) -> dict[str, Target]:
    """Checkpoint tensor name -> target, for every tensor the model needs.

    Args:
        stacked_experts: the checkpoint holds each MoE layer's experts as the stacked
            `experts.gate_up_proj` / `experts.down_proj`; otherwise one tensor per expert and
            projection (`experts.{e}.gate_proj.weight`, ...).
    """
    spec = model.spec
    fused_rows = {"self_attn.qkv_proj": (spec.q_size, spec.kv_size, spec.kv_size),
                  "mlp.gate_up_proj": (spec.intermediate_size,) * 2}
    params = dict(model.named_parameters())
    result: dict[str, Target] = {}
    for name, param in params.items():
        if name.endswith(".weight_scale"):  # an Fp8Linear's: written with its weight
            continue
        hf_name = name if name == "lm_head.weight" else f"model.{name}"
        if name.endswith(_EXPERT_STACKS) and not stacked_experts:
            result.update(_expert_targets(name, hf_name, param.shape))
            continue
        module, _, kind = name.rpartition(".")  # kind: "weight" or "bias"
        fused = next((key for key in _FUSED if module.endswith("." + key)), None)
        if fused is None:
            result[hf_name] = Target(name, 0, param.shape[0])
            continue
        prefix = hf_name[: -len(f"{fused}.{kind}")]
        start = 0
        for part, rows in zip(_FUSED[fused], fused_rows[fused], strict=True):
            result[f"{prefix}{part}.{kind}"] = Target(name, start, rows)
            start += rows
    return result


# The MoE block's stacked parameters, [E, 2I, H] and [E, H, I] (moe.Experts).
_EXPERT_STACKS = (".experts.gate_up_proj", ".experts.down_proj")


def _expert_targets(name: str, hf_name: str, shape: torch.Size) -> dict[str, Target]:
    """The per-expert checkpoint tensors of one stacked parameter: gate then up projection in
    the rows of `gate_up_proj`, the down projection as the whole of `down_proj`'s slice."""
    prefix = hf_name.rpartition(".")[0]  # "model.layers.{i}.mlp.experts"
    num_experts, rows = shape[0], shape[1]
    result = {}
    for e in range(num_experts):
        if name.endswith(".gate_up_proj"):
            result[f"{prefix}.{e}.gate_proj.weight"] = Target(name, 0, rows // 2, e)
            result[f"{prefix}.{e}.up_proj.weight"] = Target(name, rows // 2, rows // 2, e)
        else:
            result[f"{prefix}.{e}.down_proj.weight"] = Target(name, 0, rows, e)
    return result


def load_safetensors(module: torch.nn.Module, targets: dict[str, Target],
                     files: dict[pathlib.Path, list[str]], device: torch.device,
                     rename: Callable[[str], str | None], ignored: set[str],
                     what: str,
                     cut: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                     quant: QuantReader | None = None) -> None:
    """Copy checkpoint tensors into `module`'s parameters.

    Args:
        targets: canonical tensor name -> where it goes; every one must be present.
        rename: checkpoint name -> canonical name, None for tensors of another module.
        ignored: canonical names present in some checkpoints and not needed (skipped).
        what: the model named in errors.
        cut: (canonical name, tensor) -> the part this module holds (a tensor-parallel
            rank's shard); None: whole tensors.
        quant: writes the tensors of a quantized checkpoint (its scales are read past here).
    """
    from safetensors import safe_open

    present = {name for names in files.values() for name in names}
    canonical = {name: rename(name) for name in present}
    ours = {new for new in canonical.values() if new is not None}
    ignored = ignored | {name for name in ours if name.endswith(_IGNORED_SUFFIXES)
                         or (quant is not None and is_scale(name))}
    missing = sorted(set(targets) - ours)
    unexpected = sorted(ours - set(targets) - ignored)
    if missing or unexpected:
        raise InvalidRequest(
            f"checkpoint does not match {what}: "
            f"missing {_names(missing)}; unexpected {_names(unexpected)}", param="model")

    params = dict(module.named_parameters())
    # safetensors can place tensors on CUDA directly; "cuda" alone would mean device 0.
    open_device = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    for path, names in files.items():
        with safe_open(str(path), framework="pt", device=open_device) as f:
            for name in names:
                target = targets.get(canonical[name] or "")
                if target is None:
                    continue
                tensor = f.get_tensor(name)
                param: torch.Tensor = params[target.name]
                key = canonical[name] or ""
                if quant is not None:
                    tensor = quant.prepare(key or name, tensor)
                shard_scale = None
                if cut is not None:
                    whole = tensor.shape
                    if quant is not None and tensor.dtype == FP8 and param.dtype != FP8:
                        tensor = quant.dequantized(key, tensor)  # float values cut as usual
                    tensor = cut(key, tensor)
                    if tensor.dtype == FP8 and tensor.shape != whole:
                        assert quant is not None
                        shard_scale = quant.shard_scale(key, whole, tensor.shape,
                                                        functools.partial(cut, key))
                if target.expert is not None:
                    param = param[target.expert]
                dest = param[target.start: target.start + target.rows]
                if tensor.shape != dest.shape:
                    raise InvalidRequest(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(dest.shape)} from config.json", param="model")
                if quant is None:
                    dest.copy_(tensor)  # casts to the model dtype
                    continue
                quant.write(key or name, tensor, dest,
                            _scale_rows(params, target) if dest.dtype == FP8 else None,
                            target.start, shard_scale)


def _scale_rows(params: Mapping[str, torch.Tensor],
                target: Target) -> Callable[[int], torch.Tensor]:
    """The rows of an Fp8Linear's `weight_scale` that `target`'s weight rows use, for scale
    rows that each cover `divisor` weight rows."""
    scale = params[target.name.removesuffix(".weight") + ".weight_scale"]

    def rows(divisor: int) -> torch.Tensor:
        return scale[target.start // divisor: (target.start + target.rows) // divisor]
    return rows


def init_dummy(model: torch.nn.Module, seed: int) -> None:
    """N(0, DUMMY_STD) from a generator on the model's device; norm weights 1, so activations
    keep a realistic scale through the layers."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if param.dtype == FP8:  # an Fp8Linear's weight: drawn in float, quantized per row
            drawn = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
            q, scale = quantize_rows(drawn.normal_(0.0, DUMMY_STD, generator=generator))
            param.copy_(q)
            scales = model.get_parameter(f"{module}.weight_scale")
            if scales.dim() == 2:  # block scales: each block row takes its first row's
                scale = scale[:: -(-scale.numel() // scales.shape[0]), None].expand_as(scales)
            scales.copy_(scale)
            continue
        if kind == "weight_scale":
            continue
        if param.dtype == torch.uint8:  # MXFP4 experts kept packed
            draw_packed(param, name, DUMMY_STD, generator)
            continue
        if "norm" in module.rpartition(".")[2]:  # RMSNorm and LayerNorm: weight 1, bias 0
            param.fill_(1.0 if kind == "weight" else 0.0)
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)


def _names(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
