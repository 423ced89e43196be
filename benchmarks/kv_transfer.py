"""CPU benchmark: NIXL READ bandwidth of KV blocks between two worker processes (tandem's
NixlTransfer, UCX on loopback) against a plain memory copy of the same bytes in one process.

A "prefill" process owns a pool of KV blocks shaped like a 32-layer model's (each (layer, K|V)
region of a block is --region-kib, 64 KiB by default: 16 tokens x 8 KV heads x 128 dims of
float32) and publishes sources; a "decode" process reads N blocks into its own pool with
`NixlTransfer.read` (one READ, asyncio polling included). Two descriptor patterns move the same
bytes: "coalesced" (consecutive block ids on both sides: 2 * layers descriptors of N regions)
and "per-block" (local ids reversed: nothing merges, 2 * layers * N descriptors of one region).
The baseline is numpy's copyto of as many bytes in the decode process (one thread, i.e.
memcpy), timed alternately with the reads so that load from elsewhere hits both alike. Each
figure is the fastest of --repeats timings (the least disturbed by other work on the machine),
after one warm-up read (which also connects). Every UCX_TLS
setting runs in fresh processes ("default" leaves UCX_TLS unset: UCX then reads with CMA,
process_vm_readv, and sends its control messages over TCP). Settings without TCP fail here:
NIXL asks UCX for peer failure handling, which posix/sysv shared memory lack, and CMA carries no
active messages. The machine's load average is printed, as figures taken while other work runs
are not comparable.

    .venv/bin/python benchmarks/kv_transfer.py [--blocks 1 4 16 64] [--tls default sm tcp]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import os
import platform
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np
import torch

from tandem.engines.types import KvHandle, KvLayout
from tandem.kv.nixl_transfer import NixlTransfer, coalesce
from tandem.kv.transfer import TransferSource

LAYERS = 32
BLOCK_SIZE, KV_HEADS = 16, 8
VARIANT_TIMEOUT_S = 300.0


@dataclasses.dataclass
class Row:
    tls: str
    blocks: int
    pattern: str
    descriptors: int
    nbytes: int
    nixl_gbps: float | None
    copy_gbps: float | None
    note: str = ""


def make_pool(num_blocks: int, region_kib: int, fill: bool) -> torch.Tensor:
    head_dim = region_kib * 1024 // (BLOCK_SIZE * KV_HEADS * 4)
    shape = (LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, head_dim)
    # Filled either way, so every page is touched before timing.
    return torch.rand(shape) if fill else torch.zeros(shape)


def _source_main(conn: Connection, num_blocks: int, region_kib: int) -> None:
    transfer = NixlTransfer(make_pool(num_blocks, region_kib, fill=True), "bench-prefill")
    while (block_ids := conn.recv()) is not None:
        conn.send((transfer.source(block_ids), transfer.checksum(block_ids)))
    transfer.close()


def addresses(source: TransferSource) -> np.ndarray:
    return np.array([d.address for d in source.descriptors], dtype=np.uint64)


async def _bench_reads(reader: NixlTransfer, conn: Connection, tls: str, blocks: Sequence[int],
                       repeats: int) -> list[Row]:
    shape = reader.kv_cache.shape
    layout = KvLayout("float32", shape[0], shape[4], shape[5], shape[3])
    copy_src = np.random.default_rng(0).integers(0, 255, max(blocks) * reader.block_bytes,
                                                 dtype=np.uint8)
    copy_dst = np.zeros_like(copy_src)
    rows = []
    for n in blocks:
        patterns = [("coalesced", list(range(n)))]
        if n > 1:
            patterns.append(("per-block", list(range(n - 1, -1, -1))))
        for pattern, local_ids in patterns:
            remote_ids = list(range(n))
            conn.send(remote_ids)
            source, checksum = conn.recv()
            handle = KvHandle("prefill", "", "bench", "nixl", layout, n * BLOCK_SIZE,
                              tuple(remote_ids), nixl_agent_name=source.agent_name,
                              nixl_agent_metadata=source.agent_metadata,
                              descriptors=source.descriptors, nixl_memory_type=source.memory_type)
            nbytes = await reader.read(handle, local_ids, timeout_s=120)  # warm-up, connects
            if reader.checksum(local_ids) != checksum:
                raise AssertionError(f"{pattern} read of {n} blocks moved the wrong bytes")
            # Reads and copies alternate, so that load from elsewhere hits both alike.
            read_s, copy_s = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                await reader.read(handle, local_ids, timeout_s=120)
                read_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                np.copyto(copy_dst[:nbytes], copy_src[:nbytes])
                copy_s.append(time.perf_counter() - start)
            descriptors = len(coalesce(addresses(reader.source(local_ids)), addresses(source),
                                       np.zeros(len(source.descriptors), dtype=np.uint64),
                                       reader.region_bytes, 0)[0])
            rows.append(Row(tls, n, pattern, descriptors, nbytes,
                            nbytes / min(read_s) / 1e9, nbytes / min(copy_s) / 1e9))
    return rows


def _reader_main(conn: Connection, tls: str, blocks: list[int], region_kib: int,
                 repeats: int) -> None:
    """The decode process: starts the prefill process (same environment) and reads from it."""
    context = multiprocessing.get_context("spawn")
    source_conn, child = context.Pipe()
    source = context.Process(target=_source_main, args=(child, max(blocks) + 1, region_kib),
                             daemon=True)
    source.start()
    reader = NixlTransfer(make_pool(max(blocks) + 1, region_kib, fill=True), "bench-decode")
    try:
        conn.send(asyncio.run(_bench_reads(reader, source_conn, tls, blocks, repeats)))
    finally:
        reader.close()
        source_conn.send(None)
        source.join(10)
        if source.is_alive():
            source.kill()


def run_variant(tls: str, blocks: list[int], region_kib: int, repeats: int) -> list[Row]:
    """One UCX_TLS setting in fresh processes; rows with a note if it failed or hung."""
    saved = os.environ.pop("UCX_TLS", None)
    if tls != "default":
        os.environ["UCX_TLS"] = tls
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    reader = context.Process(target=_reader_main, args=(child, tls, blocks, region_kib, repeats))
    reader.start()
    child.close()  # so that the reader's death ends `poll` below
    os.environ.pop("UCX_TLS", None)
    if saved is not None:
        os.environ["UCX_TLS"] = saved
    try:
        if conn.poll(VARIANT_TIMEOUT_S):
            return conn.recv()
        note = f"no result in {VARIANT_TIMEOUT_S:.0f} s"
    except EOFError:
        note = "reader died"
    finally:
        reader.join(5)
        if reader.is_alive():
            reader.kill()
    return [Row(tls, n, "-", 0, 0, None, None, note=f"{note} (exit code {reader.exitcode})")
            for n in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", nargs="+", type=int, default=[1, 4, 16, 64],
                        help="blocks per read (a block is 2 * 32 regions)")
    parser.add_argument("--region-kib", type=int, default=64,
                        help="bytes of one (layer, K|V) region of a block, KiB")
    parser.add_argument("--tls", nargs="+", default=["default", "tcp"],
                        help="UCX_TLS settings to compare; 'default' leaves it unset")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {LAYERS} layers x 2 x {args.region_kib} KiB per block, "
          f"best of {args.repeats}; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[Row] = []
    for tls in args.tls:
        rows += run_variant(tls, args.blocks, args.region_kib, args.repeats)
    print("| UCX_TLS | blocks | MiB | pattern | descriptors | NIXL GB/s | copy GB/s | NIXL / copy |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if r.nixl_gbps is None or r.copy_gbps is None:
            print(f"| {r.tls} | {r.blocks} | - | - | - | {r.note} | - | - |")
            continue
        print(f"| {r.tls} | {r.blocks} | {r.nbytes / 2**20:.0f} | {r.pattern} | "
              f"{r.descriptors} | {r.nixl_gbps:.2f} | {r.copy_gbps:.2f} | "
              f"{r.nixl_gbps / r.copy_gbps:.2f} |")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
