"""DecoderModel: one module covering the Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and
gpt-oss decoder families.

The families differ only in switches that ModelSpec carries: q/k/v (and o) bias, per-head q/k
RMSNorm, attention sinks, sliding windows, RoPE scaling, tied embeddings, and which layers' MLPs
are sparse mixtures of experts and of which kind (moe.py). Parameter names follow transformers minus the "model." prefix,
except the fused `qkv_proj` and `gate_up_proj` and the stacked experts (see loader.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engines.reference import kernels, moe_kernels
from tandem.engines.reference.attention import Attention
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.layers import GatedMLP, RMSNorm
from tandem.engines.reference.moe import GptOssMoeBlock, SparseMoeBlock
from tandem.engines.reference.parallel.group import TensorGroup
from tandem.engines.reference.rope import RotaryEmbedding
from tandem.engines.reference.spec import ModelSpec

if TYPE_CHECKING:
    from tandem.engines.reference.aux_states import AuxStates
    from tandem.engines.reference.parallel.mirror import Mirror


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is dense or, where
    `sparse`, a mixture of experts. Under tensor parallelism the attention's and the MLP's
    outputs are each rank's partial sums, added up by one all-reduce each (`tp`)."""

    def __init__(self, spec: ModelSpec, sliding_window: int | None, sparse: bool,
                 tp: TensorGroup) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, sliding_window)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = _mlp(spec, sparse)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_layer: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        x = x + tp.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_layer))
        return x + tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))

    def finish_fused(self, attn: torch.Tensor, residual: torch.Tensor,
                     next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention's output projection `attn`, on the fused kernels: the
        residual add into the post-attention norm, the MLP (SwiGLU's activation in one kernel,
        gpt-oss's experts through moe_kernels at decode-sized batches), and its residual add
        into `next_norm` (the next layer's input norm, or the final norm). Returns that norm's
        output and the residual stream."""
        post, tp = self.post_attention_layernorm, self.tp
        normed, residual = kernels.add_rms_norm(tp.all_reduce(attn), post.weight, post.eps,
                                                residual)
        mlp = self.mlp
        if isinstance(mlp, GatedMLP):
            out = kernels.swiglu_linear(kernels.linear(normed, mlp.gate_up_proj), mlp.down_proj)
        elif isinstance(mlp, GptOssMoeBlock) and mlp.runs_fused(normed):
            out = mlp.forward_slots(normed)  # [T, K, H]: add_rms_norm sums the slots
        else:  # the experts run through torch (moe.run_experts, grouped_mm)
            out = mlp(normed)
        if tp.is_parallel:  # the slots' sum first: one all-reduce of [T, H]
            out = tp.all_reduce(out.sum(dim=1) if out.dim() == 3 else out)
        return kernels.add_rms_norm(out, next_norm.weight, next_norm.eps, residual)


def _mlp(spec: ModelSpec, sparse: bool) -> GatedMLP | SparseMoeBlock | GptOssMoeBlock:
    if not sparse:
        return GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
    if spec.moe_kind == "gpt_oss":
        return GptOssMoeBlock(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts,
                              spec.num_experts_per_tok, spec.swiglu_alpha, spec.swiglu_limit)
    return SparseMoeBlock(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts,
                          spec.num_experts_per_tok, spec.norm_topk_prob,
                          spec.router_weights_float32)


class DecoderModel(nn.Module):
    """A decoder-only transformer over a paged KV cache.

    `forward` runs the new tokens of one engine step; `compute_logits` projects only the rows the
    caller samples from (usually each sequence's last token), which keeps prefill cheap.

    Under tensor parallelism (`tp` of more than one rank) `spec` is this rank's shard
    (parallel.shard.local_spec) and `vocab_size` the whole vocabulary; every rank runs the
    same forward on its shard. Rank 0's `mirror` (set by the engine) sends each forward and
    each logits call to the other ranks before running its own.
    """

    def __init__(self, spec: ModelSpec, tp: TensorGroup | None = None,
                 vocab_size: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp or TensorGroup()
        #: The whole vocabulary (the embedding holds spec.vocab_size rows of it on this rank).
        self.vocab_size = vocab_size or spec.vocab_size
        #: Rank 0 of a tensor-parallel model: what makes the other ranks follow its calls.
        self.mirror: Mirror | None = None
        #: Where each forward copies the residual stream of an EAGLE-3 head's layers
        #: (aux_states); None: nothing is captured.
        self.aux: AuxStates | None = None
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        sparse = spec.sparse_layers or (False,) * spec.num_layers
        self.layers = nn.ModuleList(DecoderLayer(spec, window, is_sparse, self.tp)
                                    for window, is_sparse in zip(spec.sliding_windows, sparse,
                                                                 strict=True))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.head_size, spec.max_position_embeddings,
                                          spec.rope_theta, spec.rope_scaling)
        # Tied models reuse embed_tokens.weight in compute_logits; no second parameter exists.
        self.lm_head = (None if spec.tie_word_embeddings
                        else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor,
                input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run T new tokens and return their final-norm hidden states [T, hidden].

        Args:
            input_ids: [T] int64, the new tokens of all sequences, grouped as in
                `meta.query_start_loc`.
            positions: [T] int64, each token's position in its sequence (< max_position_embeddings).
            meta: where each token's K/V goes and what each sequence attends to.
            kv_cache: the whole pool, [num_layers, 2, num_blocks, block_size, kv_heads, head_size]
                (batch.allocate_kv_cache); written in place at `meta.slot_mapping`.
            input_embeds: optional (rows [M] int64, values [M, hidden]): embeddings that replace
                the token embeddings of those rows (image features at their placeholders).
        """
        if self.mirror is not None:
            self.mirror.forward(input_ids, positions, meta)
        hidden = self.embed(input_ids)
        if input_embeds is not None:
            rows, values = input_embeds
            hidden.index_copy_(0, rows, values.to(hidden.dtype))
        if self.fusable(hidden, meta.block_size):
            return self._forward_fused(hidden, positions, meta, kv_cache)
        cos, sin = self.rotary_emb(positions)  # gathered once, shared by every layer
        aux = self.aux
        for index, layer in enumerate(self.layers):
            if aux is not None:
                aux.take(index, hidden)
            hidden = layer(hidden, cos, sin, meta, kv_cache[index])
        if aux is not None:
            aux.take(len(self.layers), hidden)
        return self.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden]; vocabulary-parallel, each rank looks up the ids in its
        range and the all-reduce adds the one non-zero row of each token."""
        tp = self.tp
        if not tp.is_parallel:
            return self.embed_tokens(input_ids)
        rows = self.spec.vocab_size
        local = input_ids - tp.rank * rows
        outside = (local < 0) | (local >= rows)
        out = self.embed_tokens(local.masked_fill(outside, 0))
        return tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))

    def fusable(self, hidden: torch.Tensor, block_size: int) -> bool:
        """Whether the Triton kernels (tandem.engines.reference.kernels) serve steps over
        tensors like `hidden` and KV blocks of `block_size`: CUDA, half precision, no q/k norm,
        head size and block size powers of two >= 16 (the kernels' matrix tiles)."""
        spec = self.spec
        return (kernels.available(hidden) and not spec.qk_norm
                and _pow2_at_least_16(spec.head_size) and _pow2_at_least_16(block_size))

    def decode_syncs(self, max_batch: int) -> bool:
        """Whether a decode step of up to `max_batch` sequences reads anything on the host,
        which no CUDA graph can hold. Only MoE layers do: Mixtral's and Qwen3-MoE's expert
        loop (moe.run_experts), gpt-oss's where its Triton kernels do not serve the batch
        (float32, or more tokens than their routing kernel holds)."""
        if not self.spec.is_moe:
            return False
        if self.spec.moe_kind != "gpt_oss":
            return True
        weight = self.embed_tokens.weight
        return not moe_kernels.serves(max_batch, self.spec.num_experts,
                                      self.spec.num_experts_per_tok, weight.device,
                                      weight.dtype)

    def _forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """`forward` with the residual adds fused into the next RMSNorm (each layer's input
        norm, then the final norm), SwiGLU's activation in one kernel, and gpt-oss's experts
        through moe_kernels at decode-sized batches."""
        table = self.rotary_emb.cos_sin
        layers = cast("list[DecoderLayer]", list(self.layers))
        first = layers[0].input_layernorm
        normed, residual = kernels.add_rms_norm(hidden, first.weight, first.eps)
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        aux = self.aux
        for index, (layer, next_norm) in enumerate(zip(layers, norms)):
            if aux is not None:  # the residual stream entering this layer
                aux.take(index, residual)
            attn = layer.self_attn.forward_fused(normed, table, positions, meta, kv_cache[index])
            normed, residual = layer.finish_fused(attn, residual, next_norm)
        if aux is not None:
            aux.take(len(layers), residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for hidden states [N, hidden] from `forward`.

        The matmul runs in the model dtype, as in transformers; only the result is upcast, so
        that sampling (softmax, penalties, logprobs) works in float32. Vocabulary-parallel:
        each rank projects onto its rows, and the shards are gathered in rank order.
        """
        if self.mirror is not None:
            self.mirror.logits(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        rows = hidden.shape[0]
        if kernels.available(hidden) and hidden.is_contiguous() and rows <= kernels.SKINNY_MAX_ROWS:
            out = kernels.gemv(hidden, weight) if rows == 1 else kernels.skinny_gemm(hidden, weight)
        else:
            out = F.linear(hidden, weight)
        return self.tp.gather_columns(out.float(), self.vocab_size)
