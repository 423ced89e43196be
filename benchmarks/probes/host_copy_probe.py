"""Where the host KV tier's copy bandwidth goes (issue 25, item 3): one step's blocks between
a pinned host tier and a paged KV cache, copied several ways, on a CUDA device.

Layout as the reference engine's with Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16,
32-token blocks: 4 MiB a block, 64 runs of 64 KiB each on the device): a device pool of
`--device-blocks` blocks, a pinned host tier of `--host-slots` slots, `--step` blocks per copy at
random distinct slots and blocks. Each variant is timed with CUDA events on a side stream and
given as GB/s of block bytes moved: its first run (lazily loaded kernels, a Triton compile for
a configuration the store did not compile) and the median of --reps after a warm-up, that
median also against one plain pinned copy of the same bytes:

* `per-block`: one non-blocking copy call per block into/out of a contiguous device staging
  buffer (host_kv.py's copies before issue 25, without the scatter/gather);
* `scatter`/`gather`: the staging buffer's index_copy_/index_select alone (device memory only);
* `staged (old)`: the two together: what host_kv.py did;
* `uva WxN`: host_kv.copy_blocks, one Triton kernel that reads (or writes) the pinned slots
  through their device address and writes (reads) the blocks in place; W 32-bit words per
  program, N warps;
* `store`: HostKvStore.copy as the engine calls it, timed by its own events;
* `... + compute`: the same while the compute stream runs matrix products.

The kernel's copies are checked bit-exact both ways. Usage (on a CUDA host):
    python3 benchmarks/probes/host_copy_probe.py
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tandem.engines.reference.host_kv import HostKvStore, copy_blocks  # noqa: E402

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 32, 32, 8, 128


def timed(fn: Callable[[], None], stream: torch.cuda.Stream, reps: int) -> tuple[float, float]:
    """Seconds of fn() on `stream` (CUDA events around each run): the first run's, and the
    median of `reps` after it and a second warm-up run."""
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return times[0], statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step", type=int, default=32, help="blocks per copy")
    parser.add_argument("--device-blocks", type=int, default=256)
    parser.add_argument("--host-slots", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    n = args.step
    torch.manual_seed(0)
    kv = torch.randn((LAYERS, 2, args.device_blocks, BLOCK_SIZE, HEADS, HEAD_DIM),
                     device="cuda").to(torch.bfloat16)
    store = HostKvStore(kv, args.host_slots)
    host = store.host
    host.copy_(torch.randn(host.shape).to(torch.bfloat16))
    block_bytes = host[0].numel() * host.element_size()
    nbytes = n * block_bytes
    slots = torch.randperm(args.host_slots)[:n].tolist()
    blocks = torch.randperm(args.device_blocks)[:n].tolist()
    slots_d = torch.tensor(slots, device="cuda")
    blocks_d = torch.tensor(blocks, device="cuda")
    stage = torch.empty((n, *host.shape[1:]), dtype=host.dtype, device="cuda")
    flat_d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    rows, words = store._rows, store._row_words
    host_w, dev_w = (store._host_words, store._host_strides), (store._device_words,
                                                               store._device_strides)
    pinned: dict[str, float] = {}  # direction -> GB/s of one plain pinned copy
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {n} blocks of "
          f"{block_bytes >> 20} MiB per copy ({nbytes / 1e6:.0f} MB); median of {args.reps}")
    print(f"{'variant':28} {'first GB/s':>10} {'GB/s':>7} {'x pinned':>9}")

    def report(name: str, first: float, gbps: float) -> None:
        pinned.setdefault(name[:3], gbps)  # each direction's first row is the pinned copy
        print(f"{name:28} {first:>10.1f} {gbps:>7.1f} {gbps / pinned[name[:3]]:>9.2f}")

    def run(name: str, *fns: Callable[[], Any]) -> None:
        def fn() -> None:
            for part in fns:
                part()

        first, median = timed(fn, side, args.reps)
        report(name, nbytes / first / 1e9, nbytes / median / 1e9)

    # ---- host -> device (onboard)
    def per_block_h2d() -> None:
        for i, s in enumerate(slots):
            stage[i].copy_(host[s], non_blocking=True)

    def scatter() -> None:
        kv.index_copy_(2, blocks_d, stage.permute(1, 2, 0, 3, 4, 5))

    def uva_h2d(width: int, warps: int) -> Callable[[], None]:
        return lambda: copy_blocks(host_w[0], host_w[1], slots_d, dev_w[0], dev_w[1], blocks_d,
                                   rows, words, width, warps)

    run("H2D pinned, one copy", lambda: flat_d.copy_(flat_h, non_blocking=True))
    run("H2D per-block", per_block_h2d)
    run("H2D scatter only (device)", scatter)
    run("H2D staged (old onboard)", per_block_h2d, scatter)
    for width, warps in ((1024, 4), (4096, 4), (4096, 8), (8192, 8)):
        run(f"H2D uva {width}x{warps}", uva_h2d(width, warps))
    kv[:, :, blocks] = 0
    uva_h2d(4096, 4)()
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :, blocks].permute(2, 0, 1, 3, 4, 5).cpu(), host[slots]), "onboard"

    # ---- device -> host (offload)
    def gather() -> None:
        stage.copy_(kv.index_select(2, blocks_d).permute(2, 0, 1, 3, 4, 5))

    def per_block_d2h() -> None:
        for i, s in enumerate(slots):
            host[s].copy_(stage[i], non_blocking=True)

    def uva_d2h(width: int, warps: int) -> Callable[[], None]:
        return lambda: copy_blocks(dev_w[0], dev_w[1], blocks_d, host_w[0], host_w[1], slots_d,
                                   rows, words, width, warps)

    run("D2H pinned, one copy", lambda: flat_h.copy_(flat_d, non_blocking=True))
    run("D2H per-block", per_block_d2h)
    run("D2H gather only (device)", gather)
    run("D2H staged (old offload)", gather, per_block_d2h)
    for width, warps in ((1024, 4), (4096, 4), (4096, 8), (8192, 8)):
        run(f"D2H uva {width}x{warps}", uva_d2h(width, warps))
    host[slots] = 0
    uva_d2h(4096, 4)()
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :, blocks].permute(2, 0, 1, 3, 4, 5).cpu(), host[slots]), "offload"

    # ---- the store as the engine calls it (its own events), and under a compute load
    def store_copy(kind: str) -> None:
        pairs = list(zip(blocks, slots, strict=True))
        seconds: list[float] = []
        for _ in range(args.reps + 1):
            if kind == "offload":
                done = store.copy(pairs, [], sync=True)
            else:
                done = store.copy([], [(s, b) for b, s in pairs], sync=True)
            seconds += [t for k, _, t in done + store.finished() if k == kind]
        print(f"  store {kind} GB/s per call:",
              " ".join(f"{nbytes / t / 1e9:.1f}" for t in seconds))
        report(f"{'D2H' if kind == 'offload' else 'H2D'} store (engine path)",
               nbytes / seconds[0] / 1e9, nbytes / statistics.median(seconds[1:]) / 1e9)

    store_copy("offload")
    store_copy("onboard")
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)

    def with_compute(fn: Callable[[], None]) -> Callable[[], None]:
        def both() -> None:
            with torch.cuda.stream(torch.cuda.default_stream()):
                for _ in range(8):
                    a @ a
            fn()
        return both

    run("H2D per-block + compute", with_compute(per_block_h2d))
    run("H2D uva 4096x4 + compute", with_compute(uva_h2d(4096, 4)))
    run("D2H uva 4096x4 + compute", with_compute(uva_d2h(4096, 4)))


if __name__ == "__main__":
    main()
