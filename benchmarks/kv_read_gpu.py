"""The served path's KV read on CUDA (issue 40, item 2): tandem's own NixlTransfer between two
processes, a prompt's blocks scattered in both pools, with the transfer buffer (one descriptor:
the source gathers, the reader scatters) and without it (one descriptor per layer, K|V and
block), against a torch copy of as many bytes between the same two GPUs in one process.

The source process owns a pool of the Llama-3.1-8B shape (32 layers, 8 KV heads of 128, blocks
of 32 tokens, bf16: 4 MiB a block) filled with random bytes; for each case it makes a
TransferSource for random block ids (the gather is timed there) and the reader reads it into
random block ids of its own pool (the read is timed with its scatter, as the decode worker
waits for it). Every read is checked against the source's checksum.

    PYTHONPATH=. python3 benchmarks/kv_read_gpu.py                 # GPUs 0 -> 1 when there are two
    PYTHONPATH=. python3 benchmarks/kv_read_gpu.py --src 0 --dst 0 # both on one GPU
    PYTHONPATH=. python3 benchmarks/kv_read_gpu.py --device cpu --blocks 64 --layers 4  # no GPU
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tandem.engines.types import KvHandle, KvLayout  # noqa: E402
from tandem.kv import nixl_transfer  # noqa: E402
from tandem.kv.nixl_transfer import NixlTransfer  # noqa: E402
from tandem.kv.transfer_buffer import TransferBuffer  # noqa: E402

BLOCK = 32


def pool_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.layers, 2, args.blocks, BLOCK, args.kv_heads, args.head_dim)


def device(kind: str, index: int) -> torch.device:
    return torch.device(f"cuda:{index}") if kind == "cuda" else torch.device("cpu")


def _source_main(conn: Connection, args: argparse.Namespace) -> None:
    """Answers (block ids, buffered) with (source, checksum, gather seconds); "end" frees the
    last buffered source; None stops."""
    dev = device(args.device, args.src)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    pool = torch.randn(pool_shape(args), device=dev, dtype=torch.float32).to(dtype)
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    buffered = NixlTransfer(pool, "bench-src", buffer_blocks=args.buffer_blocks)
    plain = NixlTransfer(pool, "bench-src-plain")
    last = None
    conn.send("ready")
    while (message := conn.recv()) is not None:
        if message == "end":
            if last is not None:
                buffered.end_source(last)
                last = None
            conn.send("ok")
            continue
        block_ids, use_buffer = message
        transfer = buffered if use_buffer else plain
        started = time.perf_counter()
        source = transfer.source(block_ids)
        gather_s = time.perf_counter() - started
        if source.copied:
            last = source
        conn.send((source, transfer.checksum(block_ids), gather_s))
    buffered.close()
    plain.close()


def handle_for(source, block_ids: list[int], args: argparse.Namespace) -> KvHandle:  # noqa: ANN001
    layout = KvLayout("bfloat16", args.layers, args.kv_heads, args.head_dim, BLOCK)
    return KvHandle(worker_id="src", worker_address="", request_id="bench", backend="nixl",
                    layout=layout, num_tokens=len(block_ids) * BLOCK,
                    block_ids=tuple(block_ids), nixl_agent_name=source.agent_name,
                    nixl_agent_metadata=source.agent_metadata, descriptors=source.descriptors,
                    nixl_memory_type=source.memory_type,
                    lease_expiry_unix_ms=int(time.time() * 1000) + 60_000)


class Phases:
    """Seconds spent in each phase of the reads, by wrapping NixlTransfer's steps: posting the
    READ (initialize_xfer), its first transfer() call, waiting for DONE (polling), the
    scatter out of the transfer buffer."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self._wrap(nixl_transfer._Agent, "post_read", "post")
        self._wrap(NixlTransfer, "_wait", "wait", asynchronous=True)
        self._wrap(TransferBuffer, "scatter", "scatter", asynchronous=True)
        state = nixl_transfer._Agent.state

        def timed_state(agent, key, first=False):  # noqa: ANN001, ANN202
            started = time.perf_counter()
            try:
                return state(agent, key, first)
            finally:
                if first:
                    self.seconds.setdefault("transfer", []).append(time.perf_counter() - started)
        nixl_transfer._Agent.state = timed_state  # type: ignore[method-assign]

    def _wrap(self, owner: type, name: str, phase: str, asynchronous: bool = False) -> None:
        inner = getattr(owner, name)
        record = self.seconds.setdefault

        if asynchronous:
            async def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                started = time.perf_counter()
                try:
                    return await inner(*args, **kwargs)
                finally:
                    record(phase, []).append(time.perf_counter() - started)
        else:
            def timed(*args, **kwargs):  # type: ignore[misc]  # noqa: ANN002, ANN003, ANN202
                started = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    record(phase, []).append(time.perf_counter() - started)
        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        setattr(owner, name, staticmethod(timed) if static else timed)

    def take(self) -> dict[str, float]:
        """Median milliseconds per phase since the last take."""
        medians = {k: statistics.median(v) * 1e3 for k, v in self.seconds.items() if v}
        self.seconds.clear()
        return medians


def peer_copy_gbps(args: argparse.Namespace, nbytes: int) -> float:
    """A torch copy of `nbytes` from the source's device to the reader's (median of 10)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device(args.device, args.src))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device(args.device, args.dst))
    times = []
    for _ in range(12):
        sync(args)
        started = time.perf_counter()
        dst.copy_(src)
        sync(args)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[2:]) / 1e9


def sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        for index in {args.src, args.dst}:
            torch.cuda.synchronize(index)


async def measure(args: argparse.Namespace, conn: Connection) -> list[dict]:
    dev = device(args.device, args.dst)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    pool = torch.zeros(pool_shape(args), device=dev, dtype=dtype)
    readers = {True: NixlTransfer(pool, "bench-dst", buffer_blocks=args.buffer_blocks),
               False: NixlTransfer(pool, "bench-dst-plain")}
    rng = random.Random(0)
    rows = []
    phases = Phases()
    for tokens, max_poll_us in [(t, p) for t in args.tokens for p in args.max_poll_us]:
        n = -(-tokens // BLOCK)
        nixl_transfer._MAX_POLL_S = max_poll_us * 1e-6
        for use_buffer in (False, True):
            reads, gathers = [], []
            phases.take()
            for r in range(args.repeats + 1):
                remote_ids = rng.sample(range(args.blocks), n)
                local_ids = rng.sample(range(args.blocks), n)
                conn.send((remote_ids, use_buffer))
                source, checksum, gather_s = conn.recv()
                reader = readers[use_buffer]
                started = time.perf_counter()
                moved = await reader.read(handle_for(source, remote_ids, args), local_ids, 60)
                elapsed = time.perf_counter() - started
                if reader.checksum(local_ids) != checksum:
                    raise AssertionError(f"{tokens} tokens, buffer {use_buffer}: bytes differ")
                conn.send("end")
                conn.recv()
                if r:  # the first read of a kind loads the peer
                    reads.append(elapsed)
                    gathers.append(gather_s)
            nbytes = moved
            ms = statistics.median(reads) * 1e3
            rows.append({"tokens": tokens, "blocks": n, "buffer": use_buffer,
                         "max_poll_us": max_poll_us, "phases_ms": phases.take(),
                         "descriptors": len(source.descriptors), "mb": nbytes / 1e6,
                         "read_ms_p50": ms, "read_ms_max": max(reads) * 1e3,
                         "gather_ms_p50": statistics.median(gathers) * 1e3,
                         "gbps": nbytes / ms / 1e6})
            print(json.dumps(rows[-1]), flush=True)
    for reader in readers.values():
        reader.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--src", type=int, default=None, help="source GPU (default 0)")
    parser.add_argument("--dst", type=int, default=None,
                        help="reader GPU (default 1 when there are two, else 0)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per pool")
    parser.add_argument("--buffer-blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-poll-us", type=float, nargs="+", default=[1000.0],
                        help="the reader's longest sleep between polls of a READ, microseconds "
                        "(NixlTransfer's is 1,000); each value is a case")
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    args = parser.parse_args()
    two = args.device == "cuda" and torch.cuda.device_count() >= 2
    args.src = 0 if args.src is None else args.src
    args.dst = (1 if two else 0) if args.dst is None else args.dst
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=_source_main, args=(child, args), daemon=True)
    process.start()
    child.close()
    assert conn.recv() == "ready"
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    try:
        rows = asyncio.run(measure(args, conn))
    finally:
        conn.send(None)
        process.join(30)
    names = (f"{torch.cuda.get_device_name(args.src)} {args.src} -> {args.dst}"
             if args.device == "cuda" else "cpu")
    print(f"\nKV read between two processes, {names}; pool blocks of {BLOCK} tokens, "
          f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}\n")
    print("| prompt tokens | MB | path | poll max us | descriptors (handle) | read p50 ms (max) | "
          "GB/s | peer copy GB/s | read / peer copy | source gather p50 ms | phases p50 ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        peer = peer_copy_gbps(args, int(row["mb"] * 1e6))
        row["peer_copy_gbps"] = peer
        print(f"| {row['tokens']:,} | {row['mb']:.1f} | "
              f"{'buffer' if row['buffer'] else 'regions'} | {row['max_poll_us']:.0f} | "
              f"{row['descriptors']:,} | "
              f"{row['read_ms_p50']:.2f} ({row['read_ms_max']:.2f}) | {row['gbps']:.1f} | "
              f"{peer:.1f} | {row['gbps'] / peer:.2f}x | {row['gather_ms_p50']:.2f} | "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items()) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "kv_read_gpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
