"""The reference engine's Triton kernels against the PyTorch path they replace, on fresh random
inputs (skipped without a GPU; run on the GPU machine): residual add + RMSNorm, RoPE + cache
write, paged decode attention (with and without context splits, GQA groups, sliding windows),
SiLU-and-mul. Outputs are poisoned first, so an element left unwritten fails; bf16 results are
compared by relative norm error (METHOD: bf16 lands between 1e-3 and 1e-2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engines.reference import kernels
from tandem.engines.reference.attention import decode_attention, write_kv
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.layers import RMSNorm
from tandem.engines.reference.rope import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None,
                                reason="needs a CUDA GPU and Triton")
DTYPE = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (7, 4096), (64, 1000), (300, 128)])
def test_add_rms_norm(rows: int, cols: int) -> None:
    norm = RMSNorm(cols, 1e-5).cuda().to(DTYPE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols) * 0.5 + 1)
    x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
    residual = torch.randn(rows, cols, device="cuda", dtype=DTYPE) * 3
    out, summed = kernels.add_rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(summed, residual + x)  # the add rounds exactly as PyTorch's
    assert rel_err(out, norm(residual + x)) < 4e-3
    alone, same = kernels.add_rms_norm(x, norm.weight, norm.eps)
    assert same is x and rel_err(alone, norm(x)) < 4e-3


def test_rope_and_cache_writes_only_its_slots() -> None:
    heads, kv_heads, head, blocks, block = 8, 2, 128, 12, 16
    tokens = 37
    rope = RotaryEmbedding(head, 4096, 500000.0).cuda()
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    slots = torch.randperm(blocks * block, device="cuda")[:tokens]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head, device="cuda", dtype=DTYPE)
    cache = torch.randn(2, blocks, block, kv_heads, head, device="cuda", dtype=DTYPE)
    expected = cache.clone()
    q, k, v = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    cos, sin = rope(positions)
    q_ref = apply_rope(q.reshape(tokens, heads, head), cos, sin)
    k_ref = apply_rope(k.reshape(tokens, kv_heads, head), cos, sin)
    write_kv(expected, k_ref, v.reshape(tokens, kv_heads, head), slots)
    q_out = kernels.rope_and_cache(qkv, rope.cos_sin, positions, cache, slots, heads, kv_heads,
                                   head)
    assert rel_err(q_out, q_ref) < 4e-3
    assert rel_err(cache, expected) < 4e-3
    untouched = torch.ones(blocks * block, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    flat, flat_ref = cache.view(2, -1, kv_heads, head), expected.view(2, -1, kv_heads, head)
    assert torch.equal(flat[:, untouched], flat_ref[:, untouched])
    assert torch.equal(flat[1, slots], flat_ref[1, slots])  # v is copied, not computed


@pytest.mark.parametrize(("heads", "kv_heads", "block", "lens", "window"), [
    (32, 8, 32, [1, 17, 300, 1024], None),  # GQA 4; 1024 tokens: 4 splits
    (8, 8, 16, [5, 64, 700], None),  # MHA
    (16, 2, 32, [2000], None),  # GQA 8, one long sequence
    (32, 8, 32, [40, 900, 513], 256),  # sliding window
])
def test_paged_decode_attention(heads: int, kv_heads: int, block: int, lens: list[int],
                                window: int | None) -> None:
    head = 128
    width = max(-(-n // block) for n in lens) + 2  # wider than any sequence needs
    blocks = len(lens) * width + 3
    cache = torch.randn(2, blocks, block, kv_heads, head, device="cuda", dtype=DTYPE)
    tables = torch.randperm(blocks, device="cuda")[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head, device="cuda", dtype=DTYPE)
    context = torch.tensor(lens, device="cuda")
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long, device="cuda"),
                             list(range(len(lens) + 1)), lens, context, tables, block, True)
    ref = decode_attention(q.double(), cache.double(), meta, window)
    out = kernels.paged_decode_attention(q, cache, tables, context, block, window)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(decode_attention(q, cache, meta, window), ref) < 1e-2  # the bar is fair


def test_decode_attention_ignores_padding_width() -> None:
    # A sequence's output depends only on its context, not on how wide its table was padded
    # (CUDA graphs pad it): graphs and eager must agree exactly.
    kv_heads, heads, head, block = 8, 32, 128, 32
    cache = torch.randn(2, 80, block, kv_heads, head, device="cuda", dtype=DTYPE)
    q = torch.randn(1, heads, head, device="cuda", dtype=DTYPE)
    context = torch.tensor([600], device="cuda")
    table = torch.randperm(80, device="cuda")[:64].view(1, 64)
    narrow = kernels.paged_decode_attention(q, cache, table[:, :19], context, block)
    wide = kernels.paged_decode_attention(q, cache, table, context, block)
    assert torch.equal(narrow, wide)


@pytest.mark.parametrize("rows", [1, 9, 128])
def test_silu_and_mul(rows: int) -> None:
    width = 14336
    gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=DTYPE) * 4
    gate, up = gate_up.split(width, dim=-1)
    assert rel_err(kernels.silu_and_mul(gate_up), F.silu(gate) * up) < 4e-3


@pytest.mark.parametrize(("rows", "cols"), [(6144, 4096), (4096, 14336), (1000, 300)])
def test_gemv(rows: int, cols: int) -> None:
    weight = torch.randn(rows, cols, device="cuda", dtype=DTYPE) / cols**0.5
    x = torch.randn(1, cols, device="cuda", dtype=DTYPE)
    ref = x.double() @ weight.double().T
    assert rel_err(kernels.gemv(x, weight), ref) < 4e-3
    assert rel_err(F.linear(x, weight), ref) < 4e-3  # the bar is fair


def test_gemv_with_swiglu() -> None:
    width = 14336
    weight = torch.randn(4096, width, device="cuda", dtype=DTYPE) / width**0.5
    gate_up = torch.randn(1, 2 * width, device="cuda", dtype=DTYPE) * 3
    ref = kernels.silu_and_mul(gate_up).double() @ weight.double().T
    assert rel_err(kernels.gemv(gate_up, weight, swiglu=True), ref) < 4e-3


@pytest.mark.parametrize("rows", [2, 7, 64, 128])
def test_skinny_gemm(rows: int) -> None:
    weight = torch.randn(4096, 4096, device="cuda", dtype=DTYPE) / 64
    x = torch.randn(rows, 4096, device="cuda", dtype=DTYPE)
    ref = x.double() @ weight.double().T
    assert rel_err(kernels.skinny_gemm(x, weight), ref) < 4e-3
    odd = torch.randn(1000, 300, device="cuda", dtype=DTYPE)  # edges of every tile
    assert rel_err(kernels.skinny_gemm(x[:, :300].contiguous(), odd),
                   x[:, :300].double() @ odd.double().T) < 4e-3
