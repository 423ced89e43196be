"""The sparse mixture-of-experts MLPs: router -> top-k -> experts. `SparseMoeBlock` serves
Mixtral and Qwen3-MoE, `GptOssMoeBlock` gpt-oss (biases everywhere, a clamped SwiGLU).

Parameter names follow transformers 5's in-memory modules (`gate.weight`, the router, and the
stacked `experts.gate_up_proj` / `experts.down_proj`), so a fused-layout checkpoint loads as is;
loader.py scatters the per-expert tensors of the usual checkpoints into the stacks.

Numerics follow transformers' default experts implementation ("grouped_mm"): in
SparseMoeBlock the router's logits are taken in the model dtype and its softmax in float32;
each (token, slot) output is multiplied by its routing weight, the top-k products are summed in
slot order and the sum is cast to the model dtype once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engines.reference import kernels, moe_kernels
from tandem.engines.reference.quant import mxfp4


def run_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The routed SwiGLU experts of T tokens, each sent to K experts.

    This is the one place expert math happens, so that a grouped-GEMM kernel can replace it
    (on GPU) without touching routing.

    Args:
        hidden: [T, H] in the model dtype.
        expert_ids: [T, K] int64, each token's experts, in top-k order.
        weights: [T, K], each slot's routing weight: float32 or the model dtype (whichever the
            family weights with; the product is taken in the promoted dtype).
        gate_up: [E, 2I, H]; rows [0, I) of expert e are its gate projection, [I, 2I) its up.
        down: [E, H, I].
    Returns:
        [T, H] in hidden's dtype: out[t] = sum over k, in order, of
        weights[t, k] * down[e] @ (silu(g) * u), where (g, u) = gate_up[e] @ hidden[t] and
        e = expert_ids[t, k].

    On CPU this loops over the experts that received tokens (one batched matmul pair each,
    never a loop over tokens); the loop's trip count is read on the host, so it cannot run
    inside a CUDA graph.
    """
    num_tokens, top_k = expert_ids.shape
    hidden_size = hidden.shape[-1]
    flat_ids = expert_ids.reshape(-1)
    # Slots grouped by expert; a stable sort keeps each expert's slots in token order.
    slots = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()  # one host sync
    out = hidden.new_empty(num_tokens * top_k, hidden_size)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        expert_slots = slots[start: start + count]
        start += count
        x = hidden.index_select(0, expert_slots // top_k)
        gate, up = F.linear(x, gate_up[expert]).chunk(2, dim=-1)
        # index_copy, not index_add: every slot is written once, so the sum below is ordered.
        out.index_copy_(0, expert_slots, F.linear(F.silu(gate) * up, down[expert]))
    weighted = out.view(num_tokens, top_k, hidden_size) * weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden.dtype)


class Experts(nn.Module):
    """The stacked weights of E SwiGLU experts (transformers 5's `*Experts` layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """y = sum over the top-k experts of p_e * expert_e(x), p from a softmax router.

    Args:
        top_k: experts per token.
        norm_topk_prob: divide the top-k probabilities by their sum (Mixtral always does).
        weights_float32: weight expert outputs with the float32 probabilities (Mixtral); False
            casts them to the model dtype first (Qwen3-MoE).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, weights_float32: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weights_float32 = weights_float32
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, K] int64, routing weights [T, K]) for tokens x [T, H]."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_float32:
            weights = weights.to(x.dtype)
        return expert_ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.route(x)
        return run_experts(x, expert_ids, weights, self.experts.gate_up_proj,
                           self.experts.down_proj)


def _can_group(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: it exists (torch >= 2.8), runs on
    CPU (any float dtype) or CUDA (bfloat16), and every row stride is a multiple of 16 bytes."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, weight))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   offsets: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Rows of x [S, in], grouped by expert (`offsets` [E] int32: each group's end), times
    their expert's weight [E, in, out] plus its bias [E, out]; `expert_ids` [S] sorted.

    One grouped GEMM where torch has it (no Python loop, no host sync), else a loop over the
    groups (reads offsets on the host)."""
    if _can_group(x, weight):
        out = F.grouped_mm(x, weight, offs=offsets)
    else:
        out = x.new_empty(x.shape[0], weight.shape[-1])
        start = 0
        for expert, end in enumerate(offsets.tolist()):
            if end > start:
                torch.mm(x[start:end], weight[expert], out=out[start:end])
            start = end
    return out + bias[expert_ids]


class BiasedExperts(nn.Module):
    """gpt-oss's stacked experts, in transformers' layout: `gate_up_proj` [E, H, 2I] (input
    dim first; gate and up in interleaved columns: 0, 2, 4, ... gate, 1, 3, 5, ... up) with
    `gate_up_proj_bias` [E, 2I]; `down_proj` [E, I, H] with `down_proj_bias` [E, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size,
                                                     2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of interleaved [..., 2I] gate/up columns -> [..., I]."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoeBlock(nn.Module):
    """gpt-oss's MoE MLP: a router with bias picks the top-k logits, a softmax over just those
    gives the weights (in the model dtype), and each token's output is the weighted sum, in
    top-k order, of its experts' `down(clamped_swiglu(gate_up(x)))`, each linear
    with its bias.

    All (token, slot) pairs are sorted by expert and run as two grouped GEMMs, the same
    operations as transformers' default "grouped_mm" experts, so float32 results match it
    bit for bit. On CUDA in half precision, decode-sized batches take Triton kernels instead
    (moe_kernels: routing, sorting and both GEMMs with their epilogues in three launches, no
    host sync), which round the same way but sum in another order. With MXFP4 experts
    (quant.mxfp4.PackedExperts, CUDA only) every batch takes those GEMMs, W4A16
    (`forward_packed` past the routing kernel's size)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 alpha: float, limit: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.alpha = alpha
        self.limit = limit
        self.router = nn.Linear(hidden_size, num_experts, bias=True)
        # pack_experts swaps in PackedExperts for MXFP4 checkpoints on CUDA
        self.experts: BiasedExperts | mxfp4.PackedExperts = BiasedExperts(
            num_experts, hidden_size, intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, K] int64, routing weights [T, K] in x's dtype) for tokens x [T, H]."""
        top, expert_ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return expert_ids, torch.softmax(top, dim=-1, dtype=top.dtype)

    def runs_fused(self, x: torch.Tensor) -> bool:
        """Whether `forward_slots` serves tokens x [T, H] (CUDA, half precision, a decode-sized
        T): the Triton path, free of host syncs, which CUDA graphs can capture."""
        return moe_kernels.serves(x.shape[0], self.num_experts, self.top_k, x.device, x.dtype)

    def forward_slots(self, x: torch.Tensor) -> torch.Tensor:
        """[T, K, H]: each (token, slot)'s weighted expert output, through the Triton kernels
        (moe_kernels; only where `runs_fused`). Their sum over K is `forward`'s output."""
        return moe_kernels.experts(x, kernels.linear(x, self.router), *self._kernel_weights(),
                                   self.top_k, self.alpha, self.limit,
                                   self._kernel_scales())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_fused(x):
            return self.forward_slots(x).sum(dim=1)
        if isinstance(self.experts, mxfp4.PackedExperts):
            return self.forward_packed(x)
        return self.forward_grouped(x)

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` with MXFP4 experts, for any number of tokens (prefill): torch's routing
        and sort, then moe_kernels' W4A16 grouped GEMMs (CUDA, half precision only)."""
        expert_ids, weights = self.route(x)
        order, ends, active = moe_kernels.sort_by_expert(expert_ids, self.num_experts)
        slots = moe_kernels.sorted_experts(x, weights.reshape(-1), order, ends, active,
                                           *self._kernel_weights(), self.top_k, self.alpha,
                                           self.limit, self._kernel_scales())
        return slots.sum(dim=1)

    def _kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up, its bias, down, its bias) as moe_kernels takes them: bf16 stacks, or
        MXFP4 blocks."""
        e = self.experts
        if isinstance(e, mxfp4.PackedExperts):
            return e.gate_up_proj_blocks, e.gate_up_proj_bias, e.down_proj_blocks, e.down_proj_bias
        return e.gate_up_proj, e.gate_up_proj_bias, e.down_proj, e.down_proj_bias

    def _kernel_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        e = self.experts
        if isinstance(e, mxfp4.PackedExperts):
            return e.gate_up_proj_scales, e.down_proj_scales
        return None

    def forward_grouped(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` through torch: routing, an on-device sort by expert, two grouped GEMMs
        (F.grouped_mm where torch serves the dtype, else a loop over the groups that reads
        their sizes on the host)."""
        num_tokens, hidden_size = x.shape
        expert_ids, weights = self.route(x)
        experts = self.experts
        assert isinstance(experts, BiasedExperts), "MXFP4 experts run forward_packed"
        flat_ids = expert_ids.reshape(-1)
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        # Each expert's group ends after the last slot with an id <= its own (no host sync).
        all_ids = torch.arange(experts.gate_up_proj.shape[0], device=x.device)
        offsets = torch.searchsorted(sorted_ids, all_ids, right=True).to(torch.int32)
        gate_up = grouped_linear(x[order // self.top_k], experts.gate_up_proj,
                                 experts.gate_up_proj_bias, offsets, sorted_ids)
        out = grouped_linear(clamped_swiglu(gate_up, self.alpha, self.limit),
                             experts.down_proj, experts.down_proj_bias, offsets, sorted_ids)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(out)
        unsorted[order] = out  # back to (token, slot) order, so the sum runs in slot order
        return unsorted.view(num_tokens, self.top_k, hidden_size).sum(dim=1).to(x.dtype)


def pack_experts(model: nn.Module) -> int:
    """Replace the experts (BiasedExperts) of every gpt-oss MoE block of `model` by
    mxfp4.PackedExperts of the same shape (on `model`'s device: call it on the meta device,
    before the weights are loaded). Returns how many blocks it changed."""
    count = 0
    for module in model.modules():
        if isinstance(module, GptOssMoeBlock) and isinstance(module.experts, BiasedExperts):
            num_experts, hidden_size, width = module.experts.gate_up_proj.shape
            module.experts = mxfp4.PackedExperts(num_experts, hidden_size, width // 2)
            count += 1
    return count
