"""A word in pinned host memory that a CUDA stream waits on: the host queues work behind a value
it has not written yet, and writes it later from any thread.

A guided decode step's mask depends on the previous step's tokens, which reach the host only
when the device has sampled them. With the wait on the stream, the thread that launches steps
queues the whole step at once (forward pass, the wait, the mask's copy up, sampling) and moves
on to the next step; another thread fills the mask in pinned memory and then writes the value.
The device meanwhile computes the forward pass, and passes the wait as soon as the value is
there (issue 25: the grammars' host work no longer sits between two launches).

The wait is a one-warp Triton kernel that polls the word with volatile loads, which read
system memory at system scope: a host write is seen within a bus round trip. Pinned memory is
mapped into the device's address space under unified addressing, so the kernel reads the very
word the host writes. Whoever queues a wait for a value must see that the value is written,
whatever happens (the kernel waits for as long as it takes).

The thread that writes the value must never be one that launches work behind the wait: with
CUDA's lazy loading (the default), the first launch of a kernel not yet loaded waits for the
device to be idle, that is for the wait to end (seen on the H100: a test that launched a new
kernel behind the wait and then wrote the value hung). The engine writes from the mask thread,
which launches nothing. A launch blocked that way must not hold the GIL either, or the mask
thread could not run: PyTorch's operators and Triton's launcher release it while they call
into CUDA. Seen on the H100: the first guided steps of every fresh engine, whose mask and
sampling kernels loaded behind the wait, did not hang (benchmarks/guided_decoding.py, issue 25).
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds (and CI) have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Values cycle through 1..WRAP (a 32-bit word, compared for equality).
WRAP = 1 << 30


def available() -> bool:
    """Whether a stream can wait on a host flag here (CUDA and Triton)."""
    return triton is not None and torch.cuda.is_available()


class HostFlag:
    """A 32-bit word in pinned memory: `wait` queues, on the current stream, a wait for a value
    to appear in it; `set` writes one. Values go up by one (`next_value`) and each is written
    after the device passed the wait for the one before: the device never misses a value."""

    def __init__(self) -> None:
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._host = self._word.numpy()
        self._last = 0

    def next_value(self) -> int:
        """The value of the next wait (1, 2, ..., WRAP, then 1 again)."""
        self._last = self._last % WRAP + 1
        return self._last

    def wait(self, value: int) -> None:
        """Queues on the current CUDA stream a wait until the word holds `value`."""
        _wait_kernel[(1,)](self._word, value, num_warps=1)

    def set(self, value: int) -> None:
        """Writes `value` (from any thread): the stream's wait for it ends."""
        self._host[0] = value

    @property
    def value(self) -> int:
        return int(self._host[0])


if triton is not None:

    @triton.jit(do_not_specialize=["value"])
    def _wait_kernel(word_ptr, value):
        seen = tl.load(word_ptr, volatile=True)
        while seen != value:
            seen = tl.load(word_ptr, volatile=True)
