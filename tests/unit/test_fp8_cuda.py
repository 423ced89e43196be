"""FP8 weights on a GPU with FP8 (compute capability 8.9+; skipped elsewhere): the Triton
kernels (one row W8A16, more rows W8A8; row and 128x128 block scales; SwiGLU fused into the
one-row kernel) against a float32 product of the dequantized weights, within each path's
error; per-token activation quantization against PyTorch's; a block-FP8 checkpoint served with its weights kept FP8 gives the logits of
the same checkpoint dequantized to bf16, through CUDA graphs."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.kernels import silu_and_mul, swiglu_linear
from tandem.engines.reference.loader import load_model
from tandem.engines.reference.quant.fp8 import Fp8Linear, fp8_gemm_supported
from tandem.engines.reference.quant.fp8_format import dequantize
from tandem.model.quantize import quantize_tensor, write_fp8_checkpoint
from tandem.model.tiny import write_tiny_model
from tests.unit.test_reference_model import make_step

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_gemm_supported(torch.device("cuda")),
    reason="needs a GPU with FP8 (compute capability 8.9+)")

DEVICE = torch.device("cuda")


def fp8_layer(n: int, k: int, block: tuple[int, int] | None, bias: bool = False,
              seed: int = 0) -> Fp8Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    q, scale = quantize_tensor(weight, "block" if block else "channel", block or (1, 1))
    layer = Fp8Linear(k, n, bias, block, torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        layer.weight.copy_(q.to(DEVICE))
        layer.weight_scale.copy_(scale.reshape(layer.weight_scale.shape).to(DEVICE))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=generator).to(torch.bfloat16))
    return layer


def reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    w = dequantize(layer.weight, layer.weight_scale, layer.block, torch.float32)
    bias = layer.bias.float() if layer.bias is not None else None
    return F.linear(x.float(), w, bias)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 5, 64, 200, 1024])
def test_fp8_linear_equals_the_dequantized_product(rows: int,
                                                   block: tuple[int, int] | None) -> None:
    layer = fp8_layer(1536, 1024, block, bias=True, seed=rows)
    x = torch.randn(rows, 1024, device=DEVICE, dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 1536)
    # One row: W8A16, the weights' values exactly, float32 sums, one bf16 rounding. More rows:
    # W8A8, the activations rounded to FP8 too (3 mantissa bits, ~2^-5 relative each).
    assert relative_error(got, reference(layer, x)) < (4e-3 if rows == 1 else 3e-2)


@pytest.mark.parametrize("group", [None, 128])
def test_one_pass_token_quantization_equals_pytorch(group: int | None) -> None:
    from tandem.engines.reference.quant import fp8_kernels
    from tandem.engines.reference.quant.fp8_format import quantize_tokens

    x = torch.randn(37, 1024, device=DEVICE, dtype=torch.bfloat16)
    q, scales = fp8_kernels.quantize_tokens(x, group)
    grouped = x.reshape(37 * (1024 // (group or 1024)), group or 1024)
    expected_q, expected_scales = quantize_tokens(grouped)
    torch.testing.assert_close(scales.reshape(-1), expected_scales.reshape(-1))
    assert torch.equal(q.reshape(grouped.shape).float(), expected_q.float())


def test_swiglu_is_fused_into_the_one_row_kernel() -> None:
    layer = fp8_layer(1024, 2048, (128, 128), seed=3)
    gate_up = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    got = swiglu_linear(gate_up, layer)
    expected = reference(layer, silu_and_mul(gate_up))
    assert relative_error(got, expected) < 4e-3


def test_fp8_layers_run_inside_a_cuda_graph() -> None:
    layer = fp8_layer(2048, 1024, None)
    x = torch.randn(1, 1024, device=DEVICE, dtype=torch.bfloat16)
    eager = layer(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_a_block_fp8_checkpoint_serves_the_logits_of_its_dequantized_weights(
        tmp_path: pathlib.Path) -> None:
    """The model's fused path (16-token KV blocks) over FP8 layers, and the same checkpoint
    dequantized to bf16 while loading, each against it dequantized to float32: the FP8
    model's error is its format's, relative to bf16's own rounding (tiny random models
    amplify rounding through their layers)."""
    src = write_tiny_model(tmp_path / "llama", "llama", seed=2, hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64)
    path = write_fp8_checkpoint(src, tmp_path / "fp8", "fp8-block", (128, 128))
    prompt = [(7 * i) % 3000 + 5 for i in range(40)]
    logits = {}
    for dtype, fp8_layers in ((torch.bfloat16, True), (torch.bfloat16, False),
                              (torch.float32, False)):
        model, spec = load_model(path, dtype, DEVICE, fp8_layers=fp8_layers)
        assert any(isinstance(m, Fp8Linear) for m in model.modules()) is fp8_layers
        ids, positions, meta = make_step([(prompt, [0, 1, 2], 0)], block_size=16)
        meta = dataclasses.replace(
            meta, slot_mapping=meta.slot_mapping.to(DEVICE),
            context_lens_t=meta.context_lens_t.to(DEVICE),
            block_tables=meta.block_tables.to(DEVICE))
        cache = allocate_kv_cache(spec.num_layers, 4, 16, spec.num_kv_heads, spec.head_size,
                                  spec.dtype, DEVICE)
        with torch.no_grad():
            hidden = model(ids.to(DEVICE), positions.to(DEVICE), meta, cache)
            logits[(dtype, fp8_layers)] = model.compute_logits(hidden).float()
    exact = logits[(torch.float32, False)]
    fp8_error = relative_error(logits[(torch.bfloat16, True)], exact)
    bf16_error = relative_error(logits[(torch.bfloat16, False)], exact)
    # 40 rows run W8A8: each product also rounds the activations to FP8 (3 mantissa bits
    # against bf16's 8, ~6x the error per product, ~0.026 vs ~0.004 in the kernel tests).
    assert fp8_error < 8 * bf16_error, (fp8_error, bf16_error)


def test_paged_decode_reads_an_fp8_cache() -> None:
    """--kv-cache-dtype fp8: the Triton decode kernel over e4m3 blocks equals attention over
    the same blocks read back in float64 (the FP8 rounding is the cache's, not the kernel's)."""
    from tandem.engines.reference import kernels
    from tandem.engines.reference.attention import decode_attention
    from tandem.engines.reference.batch import AttentionMetadata

    heads, kv_heads, head, block, lens = 32, 8, 128, 32, [1, 300, 1024]
    width = max(-(-n // block) for n in lens) + 1
    blocks = len(lens) * width + 2
    cache = torch.randn(2, blocks, block, kv_heads, head, device=DEVICE).to(torch.float8_e4m3fn)
    tables = torch.randperm(blocks, device=DEVICE)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head, device=DEVICE, dtype=torch.bfloat16)
    context = torch.tensor(lens, device=DEVICE)
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long, device=DEVICE),
                             list(range(len(lens) + 1)), lens, context, tables, block, True)
    ref = decode_attention(q.double(), cache.double(), meta)
    for per_iter in (None, 64, 128):
        out = kernels.paged_decode_attention(q, cache, tables, context, block,
                                             tokens_per_iter=per_iter)
        assert relative_error(out, ref.float()) < 1e-2, per_iter


def test_rope_and_cache_writes_fp8() -> None:
    from tandem.engines.reference import kernels
    from tandem.engines.reference.rope import RotaryEmbedding

    heads, kv_heads, head, block, tokens = 8, 2, 128, 16, 5
    rope = RotaryEmbedding(head, 4096, 500000.0).cuda()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head, device=DEVICE,
                      dtype=torch.bfloat16)
    positions = torch.arange(tokens, device=DEVICE) + 7
    slots = torch.tensor([3, 40, 41, 9, 60], device=DEVICE)
    fp8 = torch.zeros(2, 4, block, kv_heads, head, device=DEVICE, dtype=torch.float8_e4m3fn)
    bf16 = torch.zeros(2, 4, block, kv_heads, head, device=DEVICE, dtype=torch.bfloat16)
    for cache in (fp8, bf16):
        kernels.rope_and_cache(qkv, rope.cos_sin, positions, cache, slots, heads, kv_heads, head)
    # The FP8 cache holds the bf16 cache's values rounded to e4m3.
    assert torch.equal(fp8.float(), bf16.to(torch.float8_e4m3fn).float())


def test_checkpoint_kv_scales_keep_an_fp8_cache_in_range_on_the_gpu(tmp_path: pathlib.Path
                                                                    ) -> None:
    """quant.kv_scales through the fused CUDA path: RoPE and the cache write in one kernel, the
    prompt's attention, then decode steps through the paged decode kernel over the FP8 blocks.
    K and V far past e4m3's range (tests/unit/test_fp8_kv_scales.py's blown-up model): with the
    checkpoint's scales folded in, the logits stay within FP8's rounding (against float32,
    relative to bf16's); without them the cache overflows."""
    from tests.unit.test_fp8_kv_scales import blown_up, with_scales

    src = write_tiny_model(tmp_path / "llama", "llama", seed=4)
    unscaled = write_fp8_checkpoint(blown_up(src, tmp_path / "blown"), tmp_path / "fp8",
                                    "ct-channel")
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for item in unscaled.iterdir():
        (scaled / item.name).write_bytes(item.read_bytes())
    with_scales(scaled)
    tokens = [(7 * i) % 3000 + 5 for i in range(40)]

    def logits(path: pathlib.Path, kv_dtype: torch.dtype,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        model, spec = load_model(path, dtype, DEVICE, kv_scales=kv_dtype == torch.float8_e4m3fn)
        cache = allocate_kv_cache(spec.num_layers, 4, 16, spec.num_kv_heads, spec.head_size,
                                  kv_dtype, DEVICE)
        out = []
        for length in (36, 37, 38, 39, 40):  # the prompt, then one token per step
            cached = 0 if length == 36 else length - 1
            ids, positions, meta = make_step([(tokens[:length], [0, 1, 2], cached)],
                                             decode=length > 36, block_size=16)
            meta = dataclasses.replace(
                meta, slot_mapping=meta.slot_mapping.to(DEVICE),
                context_lens_t=meta.context_lens_t.to(DEVICE),
                block_tables=meta.block_tables.to(DEVICE))
            with torch.no_grad():
                hidden = model(ids.to(DEVICE), positions.to(DEVICE), meta, cache)
                out.append(model.compute_logits(hidden[-1:]).float())
        return torch.cat(out)

    exact = logits(scaled, torch.float32, torch.float32)  # nothing rounded but the weights
    bf16_error = relative_error(logits(scaled, torch.bfloat16), exact)
    fp8_error = relative_error(logits(scaled, torch.float8_e4m3fn), exact)
    # e4m3 keeps 3 mantissa bits of K and V against bf16's 8 (tiny random models amplify
    # rounding through their layers: the bound is relative to bf16's own).
    assert fp8_error < 8 * bf16_error, (fp8_error, bf16_error)
    assert not relative_error(logits(unscaled, torch.float8_e4m3fn), exact) < 0.5
