"""What every rank of the reference engine builds the same way: the size of its KV pool."""
from __future__ import annotations

import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.spec import ModelSpec
from tandem.errors import InvalidRequest

#: --kv-cache-dtype values: the model's dtype, or FP8 e4m3 (K and V stored with scale 1.0, as
#: TensorRT-LLM and vLLM do without calibrated scales; read back in the model's dtype).
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}


def kv_cache_dtype(args: EngineArgs, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for a model computing in `dtype`.

    Raises:
        InvalidRequest: an unknown --kv-cache-dtype.
    """
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidRequest(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{args.kv_cache_dtype!r}", param="kv_cache_dtype")
    return KV_CACHE_DTYPES[args.kv_cache_dtype] or dtype


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or its uint8 view when it is FP8 (PyTorch's index_copy_ takes no FP8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of every layer (K and V) of `spec`'s heads."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_size * element


def num_kv_blocks(args: EngineArgs, bytes_per_block: int, device: torch.device) -> int:
    """KV pool size in blocks: --num-gpu-blocks-override, else the budget of the device's
    memory (CUDA: free_gpu_memory_fraction of the free memory, and with gpu_memory_fraction
    of what is left of this worker's share after what it holds already) or kv_cache_cpu_bytes.

    Raises:
        InvalidRequest: gpu_memory_fraction outside [0, 1], or a budget that holds no block.
    """
    # Checked here rather than in batching.validation.validate_args: only this engine reads it.
    if not 0.0 <= args.gpu_memory_fraction <= 1.0:  # NaN too
        raise InvalidRequest(f"gpu_memory_fraction must be within [0, 1] (0: the whole GPU), "
                             f"got {args.gpu_memory_fraction}", param="gpu_memory_fraction")
    if args.num_gpu_blocks:
        return args.num_gpu_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free * args.free_gpu_memory_fraction)
        if args.gpu_memory_fraction > 0:
            # A GPU shared with other workers: this worker's share of the total, less what its
            # allocator holds already (weights, buffers), whatever the others hold now; the
            # free memory still caps it (another worker may be over its share). The CUDA
            # context lies outside the allocator: 1 - free_gpu_memory_fraction covers it.
            share = int(args.gpu_memory_fraction * total)
            held = torch.cuda.memory_reserved(device)
            budget = min(budget, int((share - held) * args.free_gpu_memory_fraction))
            if budget < bytes_per_block:
                raise InvalidRequest(
                    f"--gpu-memory-fraction {args.gpu_memory_fraction} gives this worker "
                    f"{share} bytes of the GPU's {total}, the weights and buffers took {held}, "
                    f"and {free} bytes are free: that leaves no KV block of {bytes_per_block} "
                    "bytes; raise --gpu-memory-fraction (and lower the other workers' on this "
                    "GPU)", param="gpu_memory_fraction")
    else:
        budget = args.kv_cache_cpu_bytes
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise InvalidRequest(f"the KV cache budget ({budget} bytes) holds no block of "
                             f"{bytes_per_block} bytes", param="num_gpu_blocks")
    return blocks
