"""How a checkpoint is cut across the ranks of a tensor-parallel model (Megatron's layout).

- attention: q/k/v projections column-parallel by head (each rank its heads' rows), o_proj
  row-parallel (each rank its heads' columns; the partial outputs are summed by an
  all-reduce). KV heads are split like the query heads; with fewer KV heads than ranks each
  rank keeps the one KV head its query heads read (replicated), so a rank's KV pool holds only
  its own heads either way. gpt-oss's sinks go with their heads.
- MLP, dense and every expert: gate/up column-parallel over the intermediate width, down
  row-parallel. Experts stay on every rank, each cut in width (tensor parallelism of the
  experts, not expert parallelism).
- embedding and LM head: vocabulary-parallel, each rank a contiguous range of rows, the
  vocabulary padded with zero rows to a multiple of the rank count.
- norms, q/k norms and the MoE router: replicated.

A bias after a row-parallel layer would be summed `size` times by the all-reduce, so only
rank 0 keeps it; the other ranks hold zeros there.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tandem.engines.reference.spec import ModelSpec
from tandem.errors import InvalidRequest


def check(spec: ModelSpec, size: int) -> None:
    """Raises InvalidRequest (param="tensor_parallel_size") when the model cannot be cut into
    `size` equal shards, naming the dimension that does not divide."""
    if size < 1:
        raise InvalidRequest(f"--tensor-parallel-size must be at least 1, got {size}",
                             param="tensor_parallel_size")
    widths = {"attention heads (num_attention_heads)": spec.num_heads}
    if not all(spec.sparse_layers) or not spec.is_moe:
        widths["the MLP width (intermediate_size)"] = spec.intermediate_size
    if spec.is_moe:
        widths["the experts' width (moe_intermediate_size)"] = spec.moe_intermediate_size
    for what, value in widths.items():
        if value % size:
            raise InvalidRequest(f"--tensor-parallel-size {size} does not divide {what}, "
                                 f"{value}", param="tensor_parallel_size")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise InvalidRequest(f"--tensor-parallel-size {size} and the model's {kv} KV heads: "
                             "one must divide the other (each rank holds an equal share of "
                             "the KV heads, or one replicated head)",
                             param="tensor_parallel_size")


def local_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The shape one rank's modules take: its heads, its share of every MLP width and of the
    (padded) vocabulary."""
    if size == 1:
        return spec
    return dataclasses.replace(
        spec, num_heads=spec.num_heads // size, num_kv_heads=max(1, spec.num_kv_heads // size),
        intermediate_size=spec.intermediate_size // size,
        moe_intermediate_size=spec.moe_intermediate_size // size,
        vocab_size=vocab_rows(spec.vocab_size, size))


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding (and LM head) on each rank."""
    return -(-vocab_size // size)


@dataclasses.dataclass(frozen=True)
class Shards:
    """Cuts the checkpoint tensors of `spec` (the whole model's shape) for `rank` of `size`."""

    spec: ModelSpec
    rank: int
    size: int

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (the canonical, "model."-prefixed
        name of the loader's parameter map)."""
        if self.size == 1:
            return tensor
        module, _, kind = name.rpartition(".")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._vocab(tensor)
        if module.endswith("self_attn.q_proj") or name.endswith("self_attn.sinks"):
            return self._even(tensor, 0)
        if module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return self._kv_heads(tensor)
        if module.endswith(("self_attn.o_proj", "mlp.down_proj")) or ".experts." in name:
            return self._row_parallel(name, kind, tensor)
        if module.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return self._even(tensor, 0)
        return tensor  # norms, the router: replicated

    def _row_parallel(self, name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """o_proj, down_proj and the experts (per-expert or stacked tensors)."""
        gpt_oss = self.spec.moe_kind == "gpt_oss"
        if name.endswith(("o_proj.bias", "mlp.down_proj.bias", "experts.down_proj_bias")):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name.endswith(("gate_proj.weight", "up_proj.weight")):  # one expert's, [I, H]
            return self._even(tensor, 0)
        if name.endswith("experts.gate_up_proj"):
            if gpt_oss:  # [E, H, 2I], gate and up interleaved: a rank's pairs are contiguous
                return self._even(tensor, 2)
            gate, up = tensor.chunk(2, dim=1)  # [E, 2I, H]: gate rows, then up rows
            return torch.cat([self._even(gate, 1), self._even(up, 1)], dim=1)
        if name.endswith("experts.gate_up_proj_bias"):  # [E, 2I], interleaved
            return self._even(tensor, 1)
        if name.endswith("experts.down_proj"):  # gpt-oss [E, I, H], else [E, H, I]
            return self._even(tensor, 1 if gpt_oss else 2)
        return self._even(tensor, tensor.dim() - 1)  # o_proj, down_proj: [H, in]

    def _even(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.chunk(self.size, dim=dim)[self.rank]

    def _kv_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        kv = self.spec.num_kv_heads
        if kv >= self.size:
            return self._even(tensor, 0)
        head = self.rank // (self.size // kv)  # the KV head this rank's query heads read
        size = self.spec.head_size
        return tensor[head * size:(head + 1) * size]

    def _vocab(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = vocab_rows(self.spec.vocab_size, self.size)
        part = tensor[self.rank * rows:(self.rank + 1) * rows]
        return F.pad(part, (0, 0, 0, rows - part.shape[0])) if part.shape[0] < rows else part
