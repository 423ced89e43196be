"""Build a DecoderModel on its device and fill it from safetensors (or with dummy weights).

The module tree is built on the meta device and then given uninitialised storage on the target
device (`to_empty`), so no tensor is ever materialised twice and nothing big passes through CPU
memory. Checkpoint names are translated to module parameters by one table derived from the model
itself (`_parameter_map`), which also gives the missing/unexpected checks for free.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import NamedTuple

import torch

from tandem.engines.reference.model import DecoderModel
from tandem.engines.reference.spec import ModelSpec
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


class _Target(NamedTuple):
    """Where one checkpoint tensor goes: rows [start, start + rows) of parameter `name`."""
    name: str
    start: int
    rows: int


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype | None, device: torch.device,
               load_format: str = "auto", seed: int = 0) -> tuple[DecoderModel, ModelSpec]:
    """Build the model described by `model_dir/config.json` on `device`, in eval mode, no grad.

    Args:
        dtype: parameter dtype; None means the config's torch_dtype.
        load_format: "auto"/"safetensors" read *.safetensors (one file or an index of shards);
            "dummy" reads config.json only and draws N(0, DUMMY_STD) weights (norms = 1) from
            `seed`, for performance work on checkpoints that are not present.
    Returns:
        (model, spec); spec.dtype is the dtype actually used, and spec.tie_word_embeddings is
        True when the checkpoint has no lm_head (the embedding is then reused, as HF does).
    Raises:
        InvalidRequest: unsupported model/dtype/load_format, no weight files, or checkpoint
            tensors that are missing, unexpected or of the wrong shape (named in the message).
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
    files: dict[pathlib.Path, list[str]] = {}
    if load_format != "dummy":
        files = _checkpoint_index(root)
        names = {name for file_names in files.values() for name in file_names}
        if not spec.tie_word_embeddings and "lm_head.weight" not in names:
            logger.info("%s has no lm_head.weight: tying it to the input embedding", root)
            spec = dataclasses.replace(spec, tie_word_embeddings=True)

    with torch.device("meta"):
        model = DecoderModel(spec)
    model = model.to(dtype).to_empty(device=device)
    model.rotary_emb.reset_cache()  # the table is computed, never loaded
    model.eval().requires_grad_(False)

    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _load_safetensors(model, files, device)
    return model, spec


def _checkpoint_index(root: pathlib.Path) -> dict[pathlib.Path, list[str]]:
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


def _parameter_map(model: DecoderModel) -> dict[str, _Target]:
    """Checkpoint tensor name -> target, for every tensor the model needs."""
    spec = model.spec
    fused_rows = {"self_attn.qkv_proj": (spec.q_size, spec.kv_size, spec.kv_size),
                  "mlp.gate_up_proj": (spec.intermediate_size,) * 2}
    params = dict(model.named_parameters())
    result: dict[str, _Target] = {}
    for name, param in params.items():
        hf_name = name if name == "lm_head.weight" else f"model.{name}"
        module, _, kind = name.rpartition(".")  # kind: "weight" or "bias"
        fused = next((key for key in _FUSED if module.endswith("." + key)), None)
        if fused is None:
            result[hf_name] = _Target(name, 0, param.shape[0])
            continue
        prefix = hf_name[: -len(f"{fused}.{kind}")]
        start = 0
        for part, rows in zip(_FUSED[fused], fused_rows[fused], strict=True):
            result[f"{prefix}{part}.{kind}"] = _Target(name, start, rows)
            start += rows
    return result


def _load_safetensors(model: DecoderModel, files: dict[pathlib.Path, list[str]],
                      device: torch.device) -> None:
    from safetensors import safe_open

    targets = _parameter_map(model)
    present = {name for names in files.values() for name in names}
    ignored = {name for name in present if name.endswith(_IGNORED_SUFFIXES)}
    if model.spec.tie_word_embeddings:
        ignored.add("lm_head.weight")  # some tied checkpoints still save a copy
    missing = sorted(set(targets) - present)
    unexpected = sorted(present - set(targets) - ignored)
    if missing or unexpected:
        raise InvalidRequest(
            f"checkpoint does not match {model.spec.architecture}: "
            f"missing {_names(missing)}; unexpected {_names(unexpected)}", param="model")

    params = dict(model.named_parameters())
    # safetensors can place tensors on CUDA directly; "cuda" alone would mean device 0.
    open_device = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    for path, names in files.items():
        with safe_open(str(path), framework="pt", device=open_device) as f:
            for name in names:
                if name not in targets:
                    continue
                target = targets[name]
                tensor = f.get_tensor(name)
                dest = params[target.name][target.start: target.start + target.rows]
                if tensor.shape != dest.shape:
                    raise InvalidRequest(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(dest.shape)} from config.json", param="model")
                dest.copy_(tensor)  # casts to the model dtype


def _init_dummy(model: DecoderModel, seed: int) -> None:
    """N(0, DUMMY_STD) from a generator on the model's device; norm weights 1, so activations
    keep a realistic scale through the layers."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)


def _names(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
