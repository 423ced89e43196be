"""Fake of tensorrt_llm/_torch/shared_tensor.py: SharedTensorContainer (from_tensor,
dump_to_dict, from_dict, get_local_view). Upstream shares the storage through CUDA IPC (or
file-system shared memory for CPU tensors), so a handle is only valid on the node that made
it; the fake keeps the tensor in a per-process registry and refuses handles from another
process."""
from __future__ import annotations

import itertools
import os
from typing import Any

_registry: dict[int, Any] = {}
_keys = itertools.count(1)


class _SharedTensorRebuildMethodRegistry:
    REBUILD_CUDA = 1
    REBUILD_CPU = 2


class SharedTensorContainer:
    def __init__(self, method_key: int, tensor_handle: dict[str, Any]) -> None:
        self.method_key = method_key
        self.tensor_handle = tensor_handle

    @classmethod
    def from_tensor(cls, tensor: Any) -> SharedTensorContainer:
        key = next(_keys)
        _registry[key] = tensor
        return cls(_SharedTensorRebuildMethodRegistry.REBUILD_CUDA, {
            "tensor_size": list(tensor.shape), "dtype": str(tensor.dtype),
            "storage_handle": key, "pid": os.getpid()})

    @classmethod
    def from_dict(cls, tensor_info: dict[str, Any]) -> SharedTensorContainer:
        if tensor_info["method_key"] != _SharedTensorRebuildMethodRegistry.REBUILD_CUDA:
            raise ValueError(f"Unsupported shared tensor method key: {tensor_info['method_key']}")
        return cls(tensor_info["method_key"], dict(tensor_info))

    def dump_to_dict(self) -> dict[str, Any]:
        return {**self.tensor_handle, "method_key": self.method_key}

    def get_local_view(self) -> Any:
        if self.tensor_handle["pid"] != os.getpid():
            raise RuntimeError(f"shared tensor handle of process {self.tensor_handle['pid']} "
                               "cannot be opened here: CUDA IPC handles are valid only on the "
                               "producer's node (the fake's, only in the producer's process)")
        return _registry[self.tensor_handle["storage_handle"]]
