"""The sampler's Exp(1) noise for a batch of seeded rows in one CUDA kernel.

The exponential race draws each row's token as argmax(probs / noise), noise a row of Exp(1)
values that depends only on the row's draw seed (`sampler.draw_seed`). Reseeding a generator
and filling one row at a time costs ~16 us of host time per row on CUDA (a seed and a kernel
launch each): ~1 ms at 64 rows, on the thread that launches a step, where a guided step's mask
fill waits behind it (issue 25). Here every row reads Philox (Triton's `tl.rand`) keyed by its
own seed at the token's column: one launch for the batch, and a row's noise is the same whatever
else is in the batch. The CPU keeps torch's generator (its stream differs from this one, as
torch's CUDA stream did).
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds (and CI) have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Columns per program.
BLOCK = 1024


def serves(out: torch.Tensor) -> bool:
    """Whether `exponential_rows` fills `out` (float32 rows on CUDA, Triton here)."""
    return (triton is not None and out.is_cuda and out.dtype == torch.float32
            and out.dim() == 2 and out.is_contiguous())


def as_int64(seed: int) -> int:
    """A 64-bit unsigned seed as the int64 of the same bits (for a torch.int64 tensor)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def exponential_rows(out: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Fills `out` [rows, cols] with Exp(1) noise, row i from seeds[i] (int64 on out's device;
    `as_int64` of the 64-bit seed), floored at float32's smallest normal so that a division by
    it is never 0/0. Queued on the current stream; returns `out`."""
    rows, cols = out.shape
    assert seeds.shape == (rows,) and seeds.dtype == torch.int64 and seeds.device == out.device
    if rows:
        grid = (rows, triton.cdiv(cols, BLOCK))
        _exponential_rows_kernel[grid](seeds, out, cols, torch.finfo(torch.float32).tiny,
                                       BLOCK=BLOCK)
    return out


if triton is not None:

    @triton.jit
    def _exponential_rows_kernel(seeds_ptr, out_ptr, n_cols, tiny, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        seed = tl.load(seeds_ptr + row)
        u = tl.rand(seed, cols)  # [0, 1)
        noise = tl.maximum(-tl.log(1.0 - u), tiny)
        tl.store(out_ptr + row * n_cols + cols, noise, mask=cols < n_cols)
