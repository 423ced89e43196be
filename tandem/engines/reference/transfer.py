"""The reference engine's KV transfer over NIXL, made the same way by every tensor-parallel
rank (each over its own shard of the pool)."""
from __future__ import annotations

import os

import torch

from tandem.kv.transfer import KvTransfer


def create_nixl_transfer(kv_cache: torch.Tensor, name: str, buffer_blocks: int) -> KvTransfer:
    """A NixlTransfer over `kv_cache` with a transfer buffer of `buffer_blocks` blocks."""
    # Imported here: aggregated workers never load NIXL.
    from tandem.kv.nixl_transfer import NixlTransfer
    if kv_cache.is_cuda:
        # UCX turns cuda_ipc GETs off when it finds no NVLink (one GPU, PCIe-only hosts)
        # and then emulates NIXL READs over TCP at ~0.6 GB/s; with them on, a READ between
        # two processes on one H200 runs at 155 GB/s for a 1 GiB prompt (RESULTS.md).
        # Read by UCX when the agent is made; a value the operator set wins.
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    return NixlTransfer(kv_cache, name, buffer_blocks=buffer_blocks)
