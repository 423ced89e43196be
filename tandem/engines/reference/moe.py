"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE: router -> top-k -> experts.

Parameter names follow transformers 5's in-memory modules (`gate.weight`, the router, and the
stacked `experts.gate_up_proj` / `experts.down_proj`), so a fused-layout checkpoint loads as is;
loader.py scatters the per-expert tensors of the usual checkpoints into the stacks.

Numerics follow transformers' default experts implementation ("grouped_mm"): the router's
logits are taken in the model dtype and its softmax in float32; each (token, slot) output is
multiplied by its routing weight, the top-k products are summed in slot order and the sum is
cast to the model dtype once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
