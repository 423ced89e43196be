"""TensorGroup: one process's place among the ranks of a tensor-parallel model, and the three
collectives the model runs (Megatron-style, one all-reduce per attention and per MLP).

With one rank every collective returns its input untouched, so a model built for one GPU pays
nothing. With more, the collectives run on the group's backend: NCCL between GPUs, gloo on the
CPU (which is how CI checks tensor parallelism on a machine without GPUs).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: Seconds the ranks wait for each other to join the group.
_JOIN_TIMEOUT_S = 600


@dataclass(frozen=True)
class TensorGroup:
    """Rank `rank` of `size`; `group` is the torch.distributed process group (None with one
    rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that schedules, samples and serves; the others follow it."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (row-parallel outputs: each rank holds a
        partial product)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[N, size * C] from each rank's [N, C] (column shards in rank order), cut to the
        first `width` columns (a vocabulary padded to a multiple of the rank count)."""
        if self.size == 1:
            return x[:, :width]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :width]

    def close(self) -> None:
        """Leaves the group (a process may then join another, as tests do)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group(self.group)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the step's inputs, which rank 0 builds)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x


def init_group(rank: int, size: int, rendezvous: str, device: torch.device,
               backend: str | None = None) -> TensorGroup:
    """Joins the group of `size` ranks that meet at `rendezvous` (a file:// URL all ranks can
    reach); blocks until every rank joined. NCCL for CUDA devices, gloo otherwise (or
    `backend`: gloo on CUDA lets tests put two ranks on one GPU, which NCCL refuses)."""
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A rank that never joins (it failed to start) fails the others after this long, not the
    # default half hour; a rank that dies later is noticed at once (ranks.Followers.watch).
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=_JOIN_TIMEOUT_S))
    return TensorGroup(rank, size, dist.group.WORLD)
