"""A checkpoint's FP8 KV-cache scales (quant.kv_scales), on the CPU.

The checkpoints here compute exactly what a plain tiny model computes, but with K and V a
thousand times too large for e4m3 (k_proj and v_proj scaled up, q_proj and o_proj down by the
same factor): with the scales a calibration would write, the FP8 cache holds them and the logits
stay within FP8's rounding of the float32 cache's; without them the cache overflows. Folding the
scales into the weights is an identity of the model's function (checked with a float32 cache,
for plain and FP8 projections and for q/k-normalised Qwen3), and every naming convention is read.
"""
from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engines.reference.loader import load_model
from tandem.engines.reference.quant.kv_scales import read_kv_scales
from tandem.errors import InvalidRequest
from tandem.model.quantize import write_fp8_checkpoint
from tandem.model.tiny import write_tiny_model
from tests.unit.test_fp8_kv_cache import prompt_logits
from tests.unit.test_reference_host_tier import BS, engine_for, tokens
from tests.unit.test_reference_model import make_step

#: How far K and V are pushed past e4m3's range (448), and the scales that bring them back.
BLOW_UP = 4000.0
SCALE = BLOW_UP / 4


def blown_up(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """`src`'s model with K and V BLOW_UP times larger and the same function."""
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.suffix != ".safetensors":
            (dst / item.name).write_bytes(item.read_bytes())
    for path in src.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in list(tensors):
            factor = {"k_proj": BLOW_UP, "v_proj": BLOW_UP, "q_proj": 1 / BLOW_UP,
                      "o_proj": 1 / BLOW_UP}.get(name.split(".")[-2])
            if factor is not None and name.endswith(".weight"):
                tensors[name] = tensors[name] * factor
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
    return dst


def with_scales(path: pathlib.Path, names: str = "ct", k: float = SCALE,
                v: float = SCALE) -> pathlib.Path:
    """Adds one K and one V scale per layer to `path`'s checkpoint, named as `names` writes
    them: "ct" (compressed-tensors), "modelopt", or "kv" (one kv_scale for both)."""
    config = json.loads((path / "config.json").read_text())
    (file,) = path.glob("*.safetensors")
    tensors = load_file(str(file))
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.self_attn"
        if names == "ct":
            tensors[f"{prefix}.k_scale"] = torch.tensor(k)
            tensors[f"{prefix}.v_scale"] = torch.tensor(v)
        elif names == "modelopt":
            tensors[f"{prefix}.k_proj.k_scale"] = torch.tensor([k])
            tensors[f"{prefix}.v_proj.v_scale"] = torch.tensor([v])
        else:
            tensors[f"{prefix}.kv_scale"] = torch.tensor(k)
    save_file(tensors, str(file), metadata={"format": "pt"})
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
        "symmetric": True}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("kv-scales")


@pytest.fixture(scope="module")
def plain(root: pathlib.Path) -> pathlib.Path:
    return write_tiny_model(root / "llama", "llama", seed=4)


@pytest.fixture(scope="module")
def unscaled(root: pathlib.Path, plain: pathlib.Path) -> pathlib.Path:
    """FP8 weights (compressed-tensors, per row) of the blown-up model, no KV scales."""
    return write_fp8_checkpoint(blown_up(plain, root / "blown"), root / "unscaled", "ct-channel")


@pytest.fixture(scope="module")
def scaled(root: pathlib.Path, unscaled: pathlib.Path) -> pathlib.Path:
    dst = root / "scaled"
    dst.mkdir()
    for item in unscaled.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return with_scales(dst)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


async def test_the_scales_keep_an_fp8_cache_in_range(unscaled: pathlib.Path,
                                                     scaled: pathlib.Path) -> None:
    prompt = tokens(random.Random(5), 250, 3 * BS)
    full = engine_for(scaled, 16)  # a float32 cache: nothing to scale
    want = await prompt_logits(full, prompt)
    fp8 = engine_for(scaled, 16, kv_cache_dtype="fp8")
    error = relative(await prompt_logits(fp8, prompt), want)
    assert 0 < error < 0.1, error  # FP8's rounding of K and V, as with a model in range
    overflowing = engine_for(unscaled, 16, kv_cache_dtype="fp8")
    error = relative(await prompt_logits(overflowing, prompt), want)
    assert not error < 0.5, error  # K and V past 448 do not survive e4m3
    for engine in (full, fp8, overflowing):
        await engine.close()


def _logits(model_dir: pathlib.Path, prompt: list[int], **kwargs: object) -> torch.Tensor:
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), **kwargs)  # type: ignore[arg-type]
    cache = torch.zeros(model.spec.num_layers, 2, 8, BS, model.spec.num_kv_heads,
                        model.spec.head_size)
    ids, positions, meta = make_step([(prompt, list(range(-(-len(prompt) // BS))), 0)],
                                     block_size=BS)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, meta, cache))


@pytest.mark.parametrize("fp8_layers", [False, True])
def test_folding_is_an_identity_of_the_model(scaled: pathlib.Path, fp8_layers: bool) -> None:
    """With a float32 cache nothing is rounded: the folded model computes what the unfolded one
    does, through plain projections (the CPU dequantizes) and FP8 ones (the row scales)."""
    prompt = tokens(random.Random(6), 250, 2 * BS + 3)
    folded = _logits(scaled, prompt, fp8_layers=fp8_layers, kv_scales=True)
    assert relative(folded, _logits(scaled, prompt, fp8_layers=fp8_layers)) < 1e-4


def test_folding_goes_into_q_and_k_norms_for_qwen3(root: pathlib.Path) -> None:
    model = write_tiny_model(root / "qwen3", "qwen3", seed=7)
    fp8 = with_scales(write_fp8_checkpoint(model, root / "qwen3-fp8", "ct-channel"), k=3.0,
                      v=0.25)
    prompt = tokens(random.Random(8), 250, 2 * BS)
    folded = _logits(fp8, prompt, kv_scales=True)
    assert relative(folded, _logits(fp8, prompt)) < 1e-4
    loaded, _ = load_model(fp8, torch.float32, torch.device("cpu"), kv_scales=True)
    attn = loaded.layers[0].self_attn
    assert attn.q_norm is not None and attn.k_norm is not None
    unfolded, _ = load_model(fp8, torch.float32, torch.device("cpu"))
    plain_attn = unfolded.layers[0].self_attn
    assert torch.allclose(attn.q_norm.weight, 3.0 * plain_attn.q_norm.weight)  # type: ignore
    assert torch.allclose(attn.k_norm.weight, plain_attn.k_norm.weight / 3.0)  # type: ignore


@pytest.mark.parametrize(("names", "want"), [("ct", (2.0, 0.5)), ("modelopt", (2.0, 0.5)),
                                             ("kv", (2.0, 2.0))])
def test_each_naming_convention_is_read(root: pathlib.Path, unscaled: pathlib.Path,
                                        names: str, want: tuple[float, float]) -> None:
    dst = root / f"names-{names}"
    dst.mkdir()
    for item in unscaled.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    with_scales(dst, names, k=2.0, v=0.5)
    (file,) = dst.glob("*.safetensors")
    found = read_kv_scales({file: list(load_file(str(file)))})
    assert found == {0: want, 1: want}


def test_a_scale_that_is_not_one_positive_number_is_refused(root: pathlib.Path,
                                                            unscaled: pathlib.Path) -> None:
    dst = root / "bad"
    dst.mkdir()
    for item in unscaled.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    with_scales(dst, k=0.0)
    (file,) = dst.glob("*.safetensors")
    with pytest.raises(InvalidRequest, match="k_scale: a KV-cache scale must be one positive"):
        read_kv_scales({file: list(load_file(str(file)))})
