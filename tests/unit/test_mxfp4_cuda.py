"""gpt-oss's MXFP4 experts kept packed on a GPU (skipped without CUDA and Triton): the W4A16
grouped GEMMs (moe_kernels with quant.mxfp4.PackedExperts) against the same block with its
experts dequantized, at decode and prefill sizes and inside a CUDA graph; a tiny gpt-oss MXFP4
checkpoint served with packed experts gives the logits of the same weights dequantized to
bf16, and its greedy tokens with CUDA graphs equal its eager ones and the bf16 model's.
test_mxfp4_interpreted.py checks the kernel's logic on the CPU."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import pathlib
import shutil
from typing import Any

import pytest
import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference import kernels, moe_kernels
from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.engine import create_reference_engine
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.moe import BiasedExperts, GptOssMoeBlock, pack_experts
from tandem.engines.reference.quant import mxfp4
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.model.quantize import write_mxfp4_checkpoint
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_model import make_step

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.serves(DEVICE, torch.bfloat16),
    reason="needs a CUDA GPU with Triton")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def moe_pair(experts: int, top_k: int, hidden: int, inter: int, seed: int = 0
             ) -> tuple[GptOssMoeBlock, GptOssMoeBlock]:
    """(packed, dense): one gpt-oss MoE block in bf16 on the GPU with MXFP4 experts, and the
    same block with those experts dequantized into float32 weights (exact)."""
    generator = torch.Generator().manual_seed(seed)
    dense = GptOssMoeBlock(hidden, inter, experts, top_k, 1.702, 7.0)
    with torch.no_grad():
        for param in dense.parameters():
            param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    packed = copy.deepcopy(dense)
    pack_experts(packed)
    p = packed.experts
    assert isinstance(p, mxfp4.PackedExperts) and isinstance(dense.experts, BiasedExperts)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = mxfp4.quantize(getattr(dense.experts, name).transpose(1, 2))
            getattr(p, name + "_blocks").copy_(blocks)
            getattr(p, name + "_scales").copy_(scales)
            getattr(p, name + "_bias").copy_(getattr(dense.experts, name + "_bias"))
        gate_up, down = p.dequantized()
        dense.experts.gate_up_proj.copy_(gate_up)
        dense.experts.down_proj.copy_(down)
    return packed.to(DEVICE, torch.bfloat16), dense.to(DEVICE)


@pytest.fixture(scope="module")
def blocks() -> tuple[GptOssMoeBlock, GptOssMoeBlock]:
    # gpt-oss-20b's hidden width (2880 = 90 x 32: column tiles past the end are masked) and
    # top-4 of 32 experts, narrower experts to keep the test small.
    return moe_pair(32, 4, 2880, 1024)


@pytest.mark.parametrize("rows", [1, 8, 64, 512, 1500])
def test_w4a16_experts_equal_the_dequantized_block(
        blocks: tuple[GptOssMoeBlock, GptOssMoeBlock], rows: int) -> None:
    """Against float32 over the dequantized weights: the kernel's error is bf16 rounding (of
    its GEMM outputs, biases and activation, as the bf16 path), like torch's bf16 grouped
    GEMMs over the same weights. Decode-sized batches take the routing kernel, 512 and 1500
    rows torch's sort; `forward_packed` serves every size."""
    packed, dense = blocks
    x = torch.randn(rows, 2880, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(rows))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        exact = dense.forward_grouped(x.float())
        bf16 = copy.deepcopy(dense).to(torch.bfloat16).forward_grouped(x)
        got = packed(x)
        sorted_path = packed.forward_packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 2880)
    assert packed.runs_fused(x) is (rows <= 256)  # moe_kernels.MAX_ROUTE_CELLS
    bf16_error = relative_error(bf16, exact)
    for out in (got, sorted_path):
        assert relative_error(out, exact) < max(2 * bf16_error, 1e-2), (
            rows, relative_error(out, exact), bf16_error)


class Pinned:
    """moe_kernels' autotuned expert GEMM launched with the first config of one decode variant
    (autotuning would test only the fastest)."""

    def __init__(self, tuner: Any, decode: int) -> None:
        self.tuner = tuner
        self.config = next(c for c in tuner.configs if c.kwargs["DECODE"] == decode)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            c = self.config
            self.tuner.fn[grid(c.kwargs)](*args, **kwargs, **c.kwargs, num_warps=c.num_warps,
                                          num_stages=c.num_stages)
        return launch


# One token takes ROWS (BLOCK_M 1), more the tl.dot variants: group, tile, tl.dot_scaled.
@pytest.mark.parametrize(("rows", "decode"), [(1, 3), (2, 0), (2, 1), (2, 2), (64, 0), (64, 1),
                                              (64, 2)])
def test_every_decode_variant_equals_the_dequantized_block(
        blocks: tuple[GptOssMoeBlock, GptOssMoeBlock], rows: int, decode: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    packed, dense = blocks
    monkeypatch.setattr(moe_kernels, "_expert_gemm_kernel",
                        Pinned(moe_kernels._expert_gemm_kernel, decode))
    x = torch.randn(rows, 2880, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(rows))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        exact = dense.forward_grouped(x.float())
        bf16_error = relative_error(copy.deepcopy(dense).to(torch.bfloat16).forward_grouped(x),
                                    exact)
        got = packed(x)
    assert relative_error(got, exact) < max(2 * bf16_error, 1e-2), (
        rows, decode, relative_error(got, exact), bf16_error)


def test_w4a16_experts_run_inside_a_cuda_graph(
        blocks: tuple[GptOssMoeBlock, GptOssMoeBlock]) -> None:
    packed, _ = blocks
    x = torch.randn(8, 2880, device=DEVICE).to(torch.bfloat16)
    with torch.no_grad():
        eager = packed.forward_slots(x)  # also autotunes, which a capture cannot
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = packed.forward_slots(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, packed.forward_slots(x), atol=0, rtol=0)
        assert not torch.equal(out, eager)


def dequantized_checkpoint(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """The MXFP4 checkpoint `src` with its experts dequantized (float32, exact) and no
    quantization_config: what a bf16 model of the same weights loads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for path in src.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        out = {}
        for name, tensor in tensors.items():
            if name.endswith(mxfp4.BLOCKS_SUFFIX):
                weight = name.removesuffix(mxfp4.BLOCKS_SUFFIX)
                out[weight] = mxfp4.dequantize(tensor, tensors[weight + mxfp4.SCALES_SUFFIX],
                                               weight).contiguous()
            elif not name.endswith(mxfp4.SCALES_SUFFIX):
                out[name] = tensor
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copyfile(path, dst / path.name)
    config = json.loads((dst / "config.json").read_text("utf-8"))
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(MXFP4, the same weights in float): a tiny gpt-oss of 8 experts, top 2."""
    root = tmp_path_factory.mktemp("gpt_oss")
    src = write_tiny_model(root / "float", "gpt_oss", seed=6, num_local_experts=8)
    packed = write_mxfp4_checkpoint(src, root / "mxfp4")
    return packed, dequantized_checkpoint(packed, root / "dequantized")


def prefill_logits(path: pathlib.Path, dtype: torch.dtype, prompt: list[int]) -> torch.Tensor:
    model, spec = load_model(path, dtype, DEVICE)
    ids, positions, meta = make_step([(prompt, [0, 1, 2, 3], 0)], block_size=16)
    meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(DEVICE),
                               context_lens_t=meta.context_lens_t.to(DEVICE),
                               block_tables=meta.block_tables.to(DEVICE))
    cache = allocate_kv_cache(spec.num_layers, 5, 16, spec.num_kv_heads, spec.head_size,
                              spec.dtype, DEVICE)
    with torch.no_grad():
        return model.compute_logits(model(ids.to(DEVICE), positions.to(DEVICE), meta, cache))


def test_a_packed_checkpoint_gives_the_logits_of_its_dequantized_weights(
        checkpoints: tuple[pathlib.Path, pathlib.Path]) -> None:
    packed_path, float_path = checkpoints
    model, _ = load_model(packed_path, torch.bfloat16, DEVICE)
    packed_layers = [m for m in model.modules() if isinstance(m, mxfp4.PackedExperts)]
    assert packed_layers and packed_layers[0].down_proj_blocks.dtype == torch.uint8
    del model
    prompt = [(7 * i) % 3000 + 5 for i in range(50)]
    exact = prefill_logits(float_path, torch.float32, prompt).float()
    packed_error = relative_error(prefill_logits(packed_path, torch.bfloat16, prompt), exact)
    bf16_error = relative_error(prefill_logits(float_path, torch.bfloat16, prompt), exact)
    assert packed_error < 2 * bf16_error + 1e-3, (packed_error, bf16_error)


def engine_tokens(path: pathlib.Path, prompts: list[list[int]], eager: bool) -> list[list[int]]:
    async def go() -> list[list[int]]:
        engine = create_reference_engine(EngineArgs(
            model=str(path), device="cuda", dtype="bfloat16", kv_block_size=16,
            num_gpu_blocks=64, enforce_eager=eager))
        await engine.start()
        try:
            params = SamplingParams(max_tokens=24, temperature=0.0, min_tokens=24)
            streams = [engine.add_request(EngineRequest(f"m{i}", tuple(p), params))
                       for i, p in enumerate(prompts)]

            async def collect(stream) -> list[int]:
                return [t async for chunk in stream for t in chunk.token_ids]

            out = await asyncio.gather(*(collect(s) for s in streams))
            if not eager:
                assert engine.graphs is not None and engine.graphs.graphs
            return out
        finally:
            await engine.close()
    return asyncio.run(go())


def test_packed_greedy_tokens_under_cuda_graphs(
        checkpoints: tuple[pathlib.Path, pathlib.Path]) -> None:
    """Decode through the CUDA graphs equals eager decode (the same kernels) and the bf16
    model of the dequantized weights (another summation order: tiny random models could flip
    a near tie, which this seed does not)."""
    packed_path, float_path = checkpoints
    prompts = [[(i * 31 + j * 7) % 3000 + 5 for j in range(n)] for i, n in enumerate((6, 19, 33))]
    graphed = engine_tokens(packed_path, prompts, eager=False)
    assert graphed == engine_tokens(packed_path, prompts, eager=True)
    assert graphed == engine_tokens(float_path, prompts, eager=False)
