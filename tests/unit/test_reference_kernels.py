"""The reference engine's Triton kernels against the PyTorch path they replace, on fresh random
inputs (skipped without a GPU; run on the GPU machine): residual add + RMSNorm (also summing an
MoE layer's slots), RoPE + cache write, paged decode attention (with and without context splits,
GQA groups, sliding windows, gpt-oss's sinks), SiLU-and-mul, GEMV and skinny GEMM (with biases),
gpt-oss's MoE kernels, the sampler's batched Exp(1) noise. Outputs are poisoned first, so an element left unwritten fails; bf16
results are compared by relative norm error (METHOD: bf16 lands between 1e-3 and 1e-2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engines.reference import draw_noise, kernels, moe_kernels
from tandem.engines.reference.attention import decode_attention, write_kv
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.layers import RMSNorm
from tandem.engines.reference.moe import GptOssMoeBlock
from tandem.engines.reference.rope import RotaryEmbedding, apply_rope
from tandem.engines.reference.sampler import draw_seed

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
@pytest.mark.parametrize("per_iter", [None, 64, 128])  # blocks per loop iteration
def test_paged_decode_attention(heads: int, kv_heads: int, block: int, lens: list[int],
                                window: int | None, per_iter: int | None) -> None:
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
    out = kernels.paged_decode_attention(q, cache, tables, context, block, window,
                                         tokens_per_iter=per_iter)
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
    for per_iter in (None, 128):
        narrow = kernels.paged_decode_attention(q, cache, table[:, :19], context, block,
                                                tokens_per_iter=per_iter)
        wide = kernels.paged_decode_attention(q, cache, table, context, block,
                                              tokens_per_iter=per_iter)
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


def test_add_rms_norm_sums_parts_first() -> None:
    norm = RMSNorm(2880, 1e-5).cuda().to(DTYPE)
    parts = torch.randn(9, 4, 2880, device="cuda", dtype=DTYPE)
    residual = torch.randn(9, 2880, device="cuda", dtype=DTYPE)
    out, summed = kernels.add_rms_norm(parts, norm.weight, norm.eps, residual)
    assert torch.equal(summed, parts.sum(1) + residual)  # torch's sum rounds once, too
    assert rel_err(out, norm(parts.sum(1) + residual)) < 4e-3


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_linear_with_bias(rows: int) -> None:
    layer = torch.nn.Linear(2880, 5120).cuda().to(DTYPE)
    x = torch.randn(rows, 2880, device="cuda", dtype=DTYPE)
    with torch.no_grad():
        ref = x.double() @ layer.weight.double().T + layer.bias.double()
        assert rel_err(kernels.linear(x, layer), ref) < 4e-3


def _poisoned_attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    junk = torch.full_like(q, float("nan"))  # its block is what the kernel's output gets next
    del junk
    return kernels.paged_decode_attention(q, *args, **kwargs)


@pytest.mark.parametrize(("lens", "window"), [
    ([1, 17, 300, 1100], None),  # 3 splits
    ([1, 17, 300, 1100], 128),  # gpt-oss's sliding layers: one piece
    ([40, 600], 8),
])
def test_paged_decode_attention_with_sinks(lens: list[int], window: int | None) -> None:
    heads, kv_heads, head, block = 64, 8, 64, 32  # gpt-oss's shape
    width = max(-(-n // block) for n in lens) + 2
    blocks = len(lens) * width + 3
    cache = torch.randn(2, blocks, block, kv_heads, head, device="cuda", dtype=DTYPE)
    tables = torch.randperm(blocks, device="cuda")[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head, device="cuda", dtype=DTYPE)
    sinks = (2 * torch.randn(heads, device="cuda")).to(DTYPE)
    context = torch.tensor(lens, device="cuda")
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long, device="cuda"),
                             list(range(len(lens) + 1)), lens, context, tables, block, True)
    ref = decode_attention(q.double(), cache.double(), meta, window, sinks.double())
    out = _poisoned_attention(q, cache, tables, context, block, window, sinks=sinks)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(decode_attention(q, cache, meta, window, sinks), ref) < 1e-2  # a fair bar
    assert rel_err(kernels.paged_decode_attention(q, cache, tables, context, block, window),
                   ref) > 5e-2  # the sinks matter
    narrow = kernels.paged_decode_attention(q, cache, tables[:, :width - 2], context, block,
                                            window, sinks=sinks)
    assert torch.equal(out, narrow)  # independent of the table's padding (CUDA graphs)


def _tie_free_logits(tokens: int, experts: int) -> torch.Tensor:
    """Router logits with no two equal in a row (exact in bf16), so that any correct top-k
    picks the same experts."""
    ranks = torch.stack([torch.randperm(experts, device="cuda") for _ in range(tokens)])
    return (ranks.float() * 0.25 - 2).to(DTYPE)


def _moe_reference(x: torch.Tensor, block: GptOssMoeBlock, logits: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts in float64 for the routing of `logits`: [T, H]."""
    top, ids = torch.topk(logits.double(), block.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    e = block.experts
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t, k in zip(*torch.ones_like(ids).nonzero(as_tuple=True)):
        expert = ids[t, k]
        h = x[t].double() @ e.gate_up_proj[expert].double() + e.gate_up_proj_bias[expert].double()
        gate = h[::2].clamp(max=block.limit)
        up = h[1::2].clamp(min=-block.limit, max=block.limit)
        h = (up + 1) * gate * torch.sigmoid(gate * block.alpha)
        out[t] += weights[t, k] * (h @ e.down_proj[expert].double() + e.down_proj_bias[expert])
    return out


@pytest.mark.parametrize("tokens", [1, 6, 64, 200])
def test_gpt_oss_moe_routing(tokens: int) -> None:
    experts, top_k = 16, 4
    logits = _tie_free_logits(tokens, experts)
    weights, order, ends, active = moe_kernels.route(logits, top_k)
    top, ids = torch.topk(logits.float(), top_k, dim=-1)
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=experts)
    assert torch.equal(ends.long(), counts.cumsum(0))
    assert torch.equal(order.long().sort().values, torch.arange(tokens * top_k, device="cuda"))
    grouped = flat[order.long()]
    assert torch.equal(grouped, grouped.sort().values)  # pairs grouped by expert...
    for start, end in zip([0, *ends[:-1].tolist()], ends.tolist()):
        assert (order[start:end].diff() > 0).all()  # ...in (token, slot) order within one
    used = counts.nonzero().flatten()
    assert torch.equal(active[:used.numel()].long(), used)
    assert (active[used.numel():] == -1).all()
    assert rel_err(weights.view(tokens, top_k), torch.softmax(top, -1)) < 4e-3


@pytest.mark.parametrize("tokens", [1, 6, 64, 200])
def test_gpt_oss_moe_kernels(tokens: int) -> None:
    """Both grouped GEMMs with their epilogues (biases, clamped SwiGLU, routing weights)
    against float64 on the same routing; the torch path meets the same bar."""
    block = GptOssMoeBlock(512, 256, 16, 4, 1.702, 7.0).cuda()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.1)  # gate_up outputs of std ~2.3: the clamps at 7 bite
    block = block.to(DTYPE)
    x = torch.randn(tokens, 512, device="cuda", dtype=DTYPE)
    logits = _tie_free_logits(tokens, 16)
    e = block.experts
    with torch.no_grad():
        junk = torch.full((tokens * 4 * 512,), float("nan"), device="cuda", dtype=DTYPE)
        del junk
        slots = moe_kernels.experts(x, logits, e.gate_up_proj, e.gate_up_proj_bias, e.down_proj,
                                    e.down_proj_bias, 4, block.alpha, block.limit)
        ref = _moe_reference(x, block, logits)
        assert rel_err(slots.sum(1), ref) < 1e-2
        assert block.runs_fused(x)
        assert torch.equal(block(x), block.forward_slots(x).sum(1))


def test_exponential_rows_are_exp1_and_a_function_of_the_seed_alone() -> None:
    """The sampler's batched noise: every row is Exp(1) (mean and variance 1, the CDF within
    a KS bound), a row depends on its seed only (not on its place in the batch or on the
    other rows), and distinct seeds (also ones past 2^63) give unrelated rows."""
    cols = 4096 + 7  # a partial last block
    seeds = [draw_seed(s, p) for s in (0, 1, 2**64 - 1) for p in range(3)]

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor([draw_noise.as_int64(v) for v in values], dtype=torch.int64,
                            device="cuda")

    out = torch.full((len(seeds), cols), float("nan"), device="cuda")
    draw_noise.exponential_rows(out, as_tensor(seeds))
    assert not out.isnan().any() and (out > 0).all()
    flat = out.double().flatten()
    assert abs(flat.mean().item() - 1) < 0.02 and abs(flat.var().item() - 1) < 0.05
    ordered = flat.sort().values.cpu()
    cdf = 1 - torch.exp(-ordered)
    grid = torch.arange(1, len(ordered) + 1, dtype=torch.float64) / len(ordered)
    assert (cdf - grid).abs().max().item() < 1.95 / len(ordered) ** 0.5  # KS, p = 0.001
    alone = torch.empty((1, cols), device="cuda")
    for i in (0, 4, len(seeds) - 1):
        draw_noise.exponential_rows(alone, as_tensor([seeds[i]]))
        assert torch.equal(alone[0], out[i])
    corr = torch.corrcoef(out.double())
    assert (corr - torch.eye(len(seeds), device="cuda", dtype=torch.float64)).abs().max() < 0.1


if kernels.triton is not None:

    @kernels.triton.jit
    def _plus_one(x_ptr, n, BLOCK: kernels.tl.constexpr):
        offsets = kernels.tl.arange(0, BLOCK)
        mask = offsets < n
        kernels.tl.store(x_ptr + offsets, kernels.tl.load(x_ptr + offsets, mask=mask) + 1,
                         mask=mask)


def test_kernels_compiled_after_the_watch_starts_are_recorded() -> None:
    """jit_watch: a kernel compiled (or loaded from Triton's disk cache) for the first time in
    the process is recorded and logged; launching it again records nothing."""
    from tandem.engines.reference import jit_watch

    if not jit_watch.watch():
        pytest.skip("this Triton has no compile hooks")
    x = torch.zeros(8, device="cuda")
    before = len(jit_watch.compiled)
    _plus_one[(1,)](x, 8, BLOCK=8)
    assert [name for name, _ in jit_watch.compiled[before:]] == ["_plus_one"]
    assert jit_watch.compiled[-1][1] >= 0
    _plus_one[(1,)](x, 8, BLOCK=8)
    assert len(jit_watch.compiled) == before + 1
    assert x.tolist() == [2.0] * 8
