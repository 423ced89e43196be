"""The reference engine's Triton kernels for gpt-oss, run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1, in a subprocess: the variable is read when the kernels are defined), so that
a machine without a GPU checks their logic: paged decode attention with sinks and windows (and
its independence from the table's padding), MoE routing and sorting, both grouped expert GEMMs,
RMSNorm summing an MoE layer's slots, GEMV and skinny GEMM with biases, the sampler's batched
Exp(1) noise. float32 (the interpreter
computes bfloat16 wrongly); autotuned kernels run their first tile. test_reference_kernels.py
checks the same kernels compiled, in bfloat16, on a GPU."""
from __future__ import annotations

import pytest

from tests.unit.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = r'''
from tandem.engines.reference import kernels, moe_kernels
from tandem.engines.reference.attention import decode_attention
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.moe import GptOssMoeBlock

kernels._gemv_tuned = Tile(kernels._gemv_tuned)
kernels._skinny_gemm_kernel = Tile(kernels._skinny_gemm_kernel)
moe_kernels._expert_gemm_kernel = Tile(moe_kernels._expert_gemm_kernel)
torch.manual_seed(0)

heads, kv_heads, block, head = 8, 2, 16, 32
for lens, window in (([5, 40, 100], None), ([5, 40, 100], 24), ([300], None),
                     ([1] * 9 + [200], None), ([100, 33], 40)):
    width = max(-(-n // block) for n in lens) + 5
    blocks = len(lens) * width + 2
    cache = torch.randn(2, blocks, block, kv_heads, head)
    tables = torch.randperm(blocks)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head)
    context = torch.tensor(lens)
    sinks = 2 * torch.randn(heads)
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long),
                             list(range(len(lens) + 1)), lens, context, tables, block, True)
    ref = decode_attention(q.double(), cache.double(), meta, window, sinks.double())
    for split, per_iter in ((32, 16), (512, 16), (64, 48), (512, 64)):
        out = kernels.paged_decode_attention(q, cache, tables, context, block, window, split,
                                             sinks=sinks, tokens_per_iter=per_iter)
        assert rel(out, ref) < 1e-5, (lens, window, split, per_iter, rel(out, ref))
        narrow = kernels.paged_decode_attention(q, cache, tables[:, :width - 5], context, block,
                                                window, split, sinks=sinks,
                                                tokens_per_iter=per_iter)
        assert torch.equal(out, narrow), (lens, window, split, per_iter)

experts, top_k = 8, 2
block_moe = GptOssMoeBlock(64, 48, experts, top_k, 1.702, 2.0)
with torch.no_grad():
    for param in block_moe.parameters():
        param.copy_(0.3 * torch.randn(param.shape))
e = block_moe.experts
for tokens in (1, 3, 37):
    logits = (torch.stack([torch.randperm(experts) for _ in range(tokens)]).float() - 3) / 4
    weights, order, ends, active = moe_kernels.route(logits, top_k)
    top, ids = torch.topk(logits, top_k, dim=-1)
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=experts)
    assert torch.equal(ends.long(), counts.cumsum(0))
    assert torch.equal(order.long().sort().values, torch.arange(tokens * top_k))
    grouped = flat[order.long()]
    assert torch.equal(grouped, grouped.sort().values)
    for start, end in zip([0, *ends[:-1].tolist()], ends.tolist()):
        assert (order[start:end].diff() > 0).all()
    used = counts.nonzero().flatten()
    assert torch.equal(active[:used.numel()].long(), used)
    assert (active[used.numel():] == -1).all()
    assert rel(weights.view(tokens, top_k), torch.softmax(top, -1)) < 1e-6
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        slots = moe_kernels.experts(x, block_moe.router(x), e.gate_up_proj, e.gate_up_proj_bias,
                                    e.down_proj, e.down_proj_bias, top_k, block_moe.alpha,
                                    block_moe.limit)
        assert rel(slots.sum(1), block_moe.forward_grouped(x)) < 1e-5, tokens
        residual, norm = torch.randn(tokens, 64), torch.randn(64)
        normed, summed = kernels.add_rms_norm(slots, norm, 1e-5, residual)
        assert torch.equal(summed, slots.sum(1) + residual)
        expected = norm * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert rel(normed, expected) < 1e-5

from tandem.engines.reference import draw_noise
from tandem.engines.reference.sampler import draw_seed

seeds = [draw_noise.as_int64(draw_seed(s, 3)) for s in (0, 1, 2**64 - 1)]
noise = draw_noise.exponential_rows(torch.empty(3, 3000), torch.tensor(seeds))
assert (noise > 0).all() and abs(noise.double().mean().item() - 1) < 0.05
alone = draw_noise.exponential_rows(torch.empty(1, 3000), torch.tensor(seeds[1:2]))
assert torch.equal(alone[0], noise[1]) and not torch.equal(noise[0], noise[1])

layer = torch.nn.Linear(300, 100)
with torch.no_grad():
    for rows in (1, 5):
        x = torch.randn(rows, 300)
        assert rel(kernels.linear(x, layer), layer(x)) < 1e-5, rows
print("ok")
'''


def test_gpt_oss_kernels_in_the_interpreter() -> None:
    run_interpreted(SCRIPT)
