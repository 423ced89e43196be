"""Quantized checkpoints in the reference engine on the CPU. FP8 in every layout read
(compressed-tensors per tensor, per channel and per block; fine-grained block FP8; ModelOpt's
export): logits equal transformers' forward over the same dequantized weights, loaded both ways
(dequantized while loading, and kept FP8 in Fp8Linear); transformers reading the same files
itself agrees; greedy tokens of the engine equal transformers' `generate`. gpt-oss with MXFP4
experts as OpenAI ships it: logits and greedy tokens equal transformers reading the checkpoint
itself. Malformed and unsupported checkpoints are refused by name."""
from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.engines.reference.loader import load_model
from tandem.engines.reference.quant.fp8 import Fp8Linear
from tandem.engines.reference.quant.scheme import read_scheme
from tandem.errors import InvalidRequest
from tandem.model.quantize import FORMATS, write_fp8_checkpoint, write_mxfp4_checkpoint
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_engine import engine_for, prompts, run
from tests.unit.test_reference_model import BLOCK_SIZE, make_step, new_cache

FAMILIES = ["llama", "qwen3", "qwen3_moe"]
#: Scale blocks small enough that the tiny models hold several per matrix.
BLOCK = (32, 32)
ATOL = 1e-4
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for family in FAMILIES:
        src = write_tiny_model(root / family, family, seed=5)
        out[family] = src
        for fmt in FORMATS:
            out[f"{family}/{fmt}"] = write_fp8_checkpoint(src, root / f"{family}-{fmt}", fmt,
                                                          BLOCK)
    return out


def reference_weights(path: pathlib.Path, fmt: str) -> dict[str, torch.Tensor]:
    """Every tensor of the FP8 checkpoint at `path`, FP8 weights replaced by weight x scale
    (each scale broadcast over its tensor, row or block), computed here independently."""
    tensors: dict[str, torch.Tensor] = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    out = {}
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float8_e4m3fn:
            continue
        stem = name.removesuffix("weight")
        scale = tensors.get(stem + "weight_scale", tensors.get(stem + "weight_scale_inv"))
        assert scale is not None, name
        w = tensor.float()
        if fmt in ("ct-block", "fp8-block"):
            full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            out[name] = w * full[: w.shape[0], : w.shape[1]]
        else:
            out[name] = w * scale.reshape(-1, 1) if scale.numel() > 1 else w * scale
    return out


def hf_reference(checkpoints: dict[str, pathlib.Path], family: str,
                 fmt: str) -> transformers.PreTrainedModel:
    """transformers' model of the float checkpoint with the quantized weights dequantized."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoints[family]), dtype=torch.float32).eval()
    weights = reference_weights(checkpoints[f"{family}/{fmt}"], fmt)
    state = model.state_dict()
    loaded = 0
    with torch.no_grad():
        for name, value in weights.items():
            if name in state:
                state[name].copy_(value)
                loaded += 1
            else:  # transformers 5 keeps experts stacked: experts.{e}.gate_proj -> gate_up_proj
                loaded += _copy_expert(state, name, value)
    assert loaded == len(weights)
    return model


def _copy_expert(state: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> int:
    prefix, _, rest = name.partition(".experts.")
    expert, proj, _ = rest.split(".")
    e = int(expert)
    if proj == "down_proj":
        state[f"{prefix}.experts.down_proj"][e].copy_(value)
    else:
        stacked = state[f"{prefix}.experts.gate_up_proj"][e]
        half = stacked.shape[0] // 2
        (stacked[:half] if proj == "gate_proj" else stacked[half:]).copy_(value)
    return 1


def tokens(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4000, (length,), generator=generator).tolist()


def tandem_logits(path: pathlib.Path, prompt: list[int], fp8_layers: bool) -> torch.Tensor:
    model, spec = load_model(path, torch.float32, torch.device("cpu"), fp8_layers=fp8_layers)
    assert any(isinstance(m, Fp8Linear) for m in model.modules()) is fp8_layers
    input_ids, positions, meta = make_step([(prompt, [3, 1, 4, 0, 2, 5][: -(-len(prompt) // 8)],
                                             0)])
    with torch.no_grad():
        return model.compute_logits(model(input_ids, positions, meta,
                                          new_cache(spec, BLOCK_SIZE)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_over_the_dequantized_weights(
        checkpoints: dict[str, pathlib.Path], family: str, fmt: str) -> None:
    prompt = tokens(37, seed=1)
    hf = hf_reference(checkpoints, family, fmt)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    path = checkpoints[f"{family}/{fmt}"]
    torch.testing.assert_close(tandem_logits(path, prompt, fp8_layers=False), expected,
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(tandem_logits(path, prompt, fp8_layers=True), expected,
                               atol=ATOL, rtol=0)
    # The quantization changed the model: the comparison above is not of the float weights.
    float_hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoints[family]), dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(float_hf(torch.tensor([prompt])).logits[0], expected,
                                  atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-tensor", "ct-channel", "ct-block"])
def test_transformers_reads_the_written_files_as_the_reference_does(
        checkpoints: dict[str, pathlib.Path], fmt: str) -> None:
    """transformers' own readers (fine-grained FP8; compressed-tensors, decompressed) of the
    files the tests write give the weights the tests compare with. (Weights, not logits:
    compressed-tensors' forward also quantizes activations, as the checkpoint asks.)"""
    path = checkpoints[f"llama/{fmt}"]
    quant = ({"quantization_config": transformers.CompressedTensorsConfig(run_compressed=False)}
             if fmt.startswith("ct-") else {})
    own = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, **quant).state_dict()
    expected = reference_weights(path, fmt)
    assert expected
    for name, value in expected.items():
        torch.testing.assert_close(own[name].float(), value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
async def test_greedy_tokens_equal_transformers(checkpoints: dict[str, pathlib.Path],
                                                family: str, fmt: str) -> None:
    hf = hf_reference(checkpoints, family, fmt)
    await assert_greedy_equal(hf, checkpoints[f"{family}/{fmt}"], [5, 23], seed=7)


async def assert_greedy_equal(hf: transformers.PreTrainedModel, path: pathlib.Path,
                              lengths: list[int], seed: int) -> None:
    """The engine's greedy tokens for prompts of `lengths` equal `hf`'s `generate`."""
    engine = engine_for(path)
    await engine.start()
    try:
        batch = prompts(engine.vocab_size, lengths, seed=seed)
        results = await run(engine, batch)
    finally:
        await engine.close()
    for prompt, (got, _) in zip(batch, results, strict=True):
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got == out[0, len(prompt):].tolist()


def test_unsupported_formats_are_refused_by_name(tmp_path: pathlib.Path) -> None:
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}
    with pytest.raises(InvalidRequest, match="pack-quantized"):
        read_scheme(tmp_path, {"quantization_config": int4})
    int8 = {"quant_method": "compressed-tensors", "format": "naive-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}
    with pytest.raises(InvalidRequest, match="8-bit int"):
        read_scheme(tmp_path, {"quantization_config": int8})
    with pytest.raises(InvalidRequest, match="'awq' is not supported"):
        read_scheme(tmp_path, {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(InvalidRequest, match="weight_block_size"):
        read_scheme(tmp_path, {"quantization_config": {"quant_method": "fp8",
                                                       "weight_block_size": [128]}})
    with pytest.raises(InvalidRequest, match="quantization must be one of"):
        read_scheme(tmp_path, {}, "int4")


def test_a_weight_without_its_scale_is_refused(checkpoints: dict[str, pathlib.Path],
                                                tmp_path: pathlib.Path) -> None:
    src = checkpoints["llama/ct-channel"]
    for file in src.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = tmp_path / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        kept = {n: f.get_tensor(n) for n in f.keys()  # noqa: SIM118
                if n != "model.layers.1.mlp.down_proj.weight_scale"}
    save_file(kept, str(weights))
    with pytest.raises(InvalidRequest, match="down_proj.weight is FP8 but has no weight_scale"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_online_fp8_quantizes_the_projections_per_row(checkpoints: dict[str, pathlib.Path]
                                                      ) -> None:
    """--quantization fp8 of a float checkpoint: each projection row quantized to FP8 with its
    own scale (within FP8's relative step of the float weight), the very model a per-channel
    FP8 checkpoint of the same weights gives."""
    prompt = tokens(21, seed=3)
    model, spec = load_model(checkpoints["llama"], torch.float32, torch.device("cpu"),
                             quantization="fp8", fp8_layers=True)
    layer = model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"]),
                                                           dtype=torch.float32)
    q = hf.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(layer.dequantized(torch.float32)[: q.shape[0]], q,
                               atol=0, rtol=2 ** -3)
    input_ids, positions, meta = make_step([(prompt, [0, 1, 2], 0)])
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, meta, new_cache(spec)))
    torch.testing.assert_close(
        logits, tandem_logits(checkpoints["llama/ct-channel"], prompt, fp8_layers=True),
        atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("mxfp4")
    return write_mxfp4_checkpoint(write_tiny_model(root / "float", "gpt_oss", seed=6),
                                  root / "mxfp4")


def test_mxfp4_round_trips_the_values_it_can_hold() -> None:
    from tandem.engines.reference.quant import mxfp4

    codes = torch.tensor(mxfp4.E2M1)
    weight = torch.stack([codes.repeat(2) * 2.0 ** e for e in range(-3, 3)])  # [6, 32]
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (6, 1, 16) and scales.shape == (6, 1)
    torch.testing.assert_close(mxfp4.dequantize(blocks, scales, "w").T, weight, atol=0, rtol=0)


def test_mxfp4_gpt_oss_equals_transformers_reading_it(gpt_oss_mxfp4: pathlib.Path) -> None:
    """transformers dequantizes the MXFP4 experts itself (on the CPU): the logits of a prompt
    and the engine's greedy tokens equal its model's."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gpt_oss_mxfp4),
                                                           dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    prompt = tokens(30, seed=4)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(tandem_logits(gpt_oss_mxfp4, prompt, fp8_layers=False),
                               expected, atol=ATOL, rtol=0)
    float_hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gpt_oss_mxfp4.parent / "float"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(float_hf(torch.tensor([prompt])).logits[0], expected,
                                  atol=ATOL, rtol=0)


async def test_mxfp4_gpt_oss_greedy_tokens_equal_transformers(gpt_oss_mxfp4: pathlib.Path
                                                             ) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gpt_oss_mxfp4),
                                                           dtype=torch.float32).eval()
    await assert_greedy_equal(hf, gpt_oss_mxfp4, [6, 19], seed=8)
