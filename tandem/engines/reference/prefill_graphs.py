"""Piecewise CUDA graphs of the steps that carry prompt tokens: everything but the attention.

A step with prompt chunks runs eagerly (its attention reads variable-length contexts that no
graph can hold), and on the 8B shape its ~450 launches cost the host ~17-25 ms whatever the
token count, against ~8 ms of device work for one 200-token prompt on an H100 (issue 25,
`benchmarks/probes/prefill_gpu.py`). So a step of up to `TOKEN_BUCKETS[-1]` tokens is padded to a
token bucket and run as num_layers + 1 graphs, one per stretch between two attentions, as vLLM's
piecewise graphs do:

    graph 0:      embed, input norm of layer 0, qkv projection, RoPE and cache write of layer 0
    attention 0:  eager (attention.Attention.attend_fused), into a static buffer
    graph i:      o_proj, norm, MLP of layer i - 1, input norm, qkv, RoPE and cache write of i
    ...
    graph L:      o_proj, norm, MLP of the last layer, the final norm

Graphs read and write only static buffers (token ids, positions, KV slots, q, the attention's
output, the residual stream, the final hidden states), sized for the largest bucket. Padding
rows are token 0 at position 0 whose K/V go to the scratch block (the KV tensor's last block,
as for the decode graphs); no attention reads them, and every other operation of a graph is
row-wise, so a real row's result does not depend on the padding. Dense models on the fused
kernels only (DecoderModel.fusable, every MLP gated): Mixtral's and Qwen3-MoE's expert loop
reads per-expert counts on the host, which no graph holds, and gpt-oss's device-side experts
(moe_kernels) are not built into these pieces yet.
Beyond the last bucket a step computes long enough that its launches hide behind the device.
"""
from __future__ import annotations

from typing import cast

import torch

from tandem.engines.reference import kernels
from tandem.engines.reference.batch import AttentionMetadata
from tandem.engines.reference.layers import GatedMLP
from tandem.engines.reference.model import DecoderLayer, DecoderModel

#: Token counts a step is padded to. Fine steps: past ~300 tokens the 8B shape is bound by its
#: matmuls on an H100, where padding costs its share of compute.
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512)


class PrefillGraphs:
    """The graphs of every token bucket, captured before serving (`capture_all`)."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, max_tokens: int) -> None:
        spec = model.spec
        device = kv_cache.device
        self.model = model
        self.kv_cache = kv_cache
        self.layers = cast("list[DecoderLayer]", list(model.layers))
        self.buckets = tuple(b for b in TOKEN_BUCKETS if b < max_tokens) + (
            min(max_tokens, TOKEN_BUCKETS[-1]),)
        largest = self.buckets[-1]
        block_size = kv_cache.shape[3]
        # Rows input ids, positions, KV slots; a padding column: token 0, position 0, the
        # scratch block's first slot.
        self.rows = torch.zeros(3, largest, dtype=torch.long, device=device)
        self._pad = torch.tensor([[0], [0], [(kv_cache.shape[2] - 1) * block_size]],
                                 device=device).expand(3, largest).contiguous()
        dtype = model.embed_tokens.weight.dtype
        self.q = torch.zeros(largest, spec.num_heads, spec.head_size, dtype=dtype, device=device)
        self.attn = torch.zeros(largest, spec.q_size, dtype=dtype, device=device)
        self.residual = torch.zeros(largest, spec.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(largest, spec.hidden_size, dtype=dtype, device=device)
        #: Bucket -> its num_layers + 1 graphs, in order.
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def supports(model: DecoderModel, kv_cache: torch.Tensor) -> bool:
        """Whether the model's steps run on the fused kernels with dense (gated) MLPs."""
        return (model.fusable(model.embed_tokens.weight, kv_cache.shape[3])
                and all(isinstance(layer.mlp, GatedMLP) for layer in model.layers))

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket a step of `num_tokens` is padded to, or None beyond the last."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            bucket: int) -> torch.Tensor:
        """The model's forward of one step (as DecoderModel.forward, no image rows) through
        the graphs of `bucket` (>= the step's token count). Returns the final hidden states
        [T, hidden], a view of a static buffer: read it before the next step."""
        graphs = self.graphs.get(bucket)
        if graphs is None:  # before the inputs' copy: a capture runs on padding rows
            graphs = self.graphs[bucket] = self._capture(bucket)
        num_tokens = input_ids.shape[0]
        self.rows[0, :num_tokens].copy_(input_ids)
        self.rows[1, :num_tokens].copy_(positions)
        self.rows[2, :num_tokens].copy_(meta.slot_mapping)
        if num_tokens < bucket:
            self.rows[:, num_tokens:bucket].copy_(self._pad[:, num_tokens:bucket])
        graphs[0].replay()
        q = self.q[:num_tokens]
        out = self.attn[:num_tokens].view(q.shape)
        for layer, kv_layer, graph in zip(self.layers, self.kv_cache, graphs[1:], strict=True):
            layer.self_attn.attend_fused(q, kv_layer, meta, out)
            graph.replay()
        return self.hidden[:num_tokens]

    def capture_all(self) -> int:
        """Captures every bucket's graphs now (kernel compiles and tunes included), so that no
        request's step waits for them. Returns the graph count."""
        for bucket in self.buckets:
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)
        torch.cuda.synchronize()
        return sum(len(graphs) for graphs in self.graphs.values())

    def _piece(self, index: int, num_tokens: int) -> None:
        """Graph `index`'s work (module docstring) over the buffers' first `num_tokens` rows."""
        model, layers, n = self.model, self.layers, num_tokens
        if index == 0:
            first = layers[0].input_layernorm
            normed, residual = kernels.add_rms_norm(model.embed(self.rows[0, :n]),
                                                    first.weight, first.eps)
        else:
            layer = layers[index - 1]
            attn = kernels.linear(self.attn[:n], layer.self_attn.o_proj)
            norm = layers[index].input_layernorm if index < len(layers) else model.norm
            normed, residual = layer.finish_fused(attn, self.residual[:n], norm)
        if model.aux is not None:  # the residual stream entering layer `index` (EAGLE-3)
            model.aux.take(index, residual)
        if index == len(layers):
            self.hidden[:n].copy_(normed)
            return
        self.residual[:n].copy_(residual)
        layers[index].self_attn.rotate_and_cache(normed, model.rotary_emb.cos_sin,
                                                 self.rows[1, :n], self.kv_cache[index],
                                                 self.rows[2, :n], self.q[:n])

    def _capture(self, bucket: int) -> list[torch.cuda.CUDAGraph]:
        # Every row a padding row, so that the warm-up's and the capture's cache writes go to
        # the scratch block. Warm up on a side stream first, as torch requires; then capture
        # on it without torch.cuda.graph's synchronize and empty_cache around each of the
        # num_layers + 1 captures (~45 ms each on the 8B shape).
        self.rows[:, :bucket].copy_(self._pad[:, :bucket])
        pieces = range(len(self.layers) + 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graphs = []
        with torch.cuda.stream(stream):
            for index in pieces:
                self._piece(index, bucket)
            for index in pieces:
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool)
                try:
                    self._piece(index, bucket)
                finally:
                    graph.capture_end()
                graphs.append(graph)
        torch.cuda.current_stream().wait_stream(stream)
        return graphs
