"""How long an asyncio loop waits for its turn while another thread runs Python between short
GIL-releasing calls (a step thread launching kernels), at several thread switch intervals
(tandem.runtime.switch_interval).

A sender thread writes one byte to a socket every --every-ms; the loop reads it (add_reader)
and records how long after the write it ran. A third thread runs a Python loop of GLUE
iterations between small torch calls (which release the GIL) for the whole run. Prints, per glue size and
interval: bytes written, reads the loop managed (each read takes every byte queued), and the
read latency p50 / p99 / max.

    .venv/bin/python benchmarks/probes/gil_handoff.py
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time

import torch


def busy(stop: threading.Event, glue: int) -> None:
    x = torch.zeros(64)
    while not stop.is_set():
        x.add_(1)  # the GIL released for the call
        total = 0
        for i in range(glue):  # Python bytecode holding it (a switch may interrupt it)
            total += i


async def one_run(interval_s: float, glue: int, messages: int, every_s: float) -> dict:
    sys.setswitchinterval(interval_s)
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    sent_at = [0.0]

    def on_read() -> None:
        b.recv(4096)
        latencies.append(time.perf_counter() - sent_at[0])

    loop.add_reader(b.fileno(), on_read)
    stop = threading.Event()
    worker = threading.Thread(target=busy, args=(stop, glue))
    worker.start()

    def send() -> None:
        for _ in range(messages):
            time.sleep(every_s)
            sent_at[0] = time.perf_counter()
            a.send(b"x")

    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    stop.set()
    worker.join()
    loop.remove_reader(b.fileno())
    a.close()
    b.close()
    ordered = sorted(latencies) or [float("nan")]
    return {"reads": len(latencies), "p50": 1000 * ordered[len(ordered) // 2],
            "p99": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "max": 1000 * ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glue", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.2])
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--every-ms", type=float, default=3.0)
    args = parser.parse_args()
    own = sys.getswitchinterval()
    print(f"\n{args.messages} one-byte writes, one every {args.every_ms} ms\n")
    print("| Python between GIL releases (loop of N) | switch interval ms | reads / writes | "
          "read latency p50 ms | p99 ms | max ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    try:
        for glue in args.glue:
            for ms in args.intervals_ms:
                r = asyncio.run(one_run(ms / 1000, glue, args.messages, args.every_ms / 1000))
                print(f"| {glue} | {ms:g} | {r['reads']} / {args.messages} | {r['p50']:.2f} | "
                      f"{r['p99']:.2f} | {r['max']:.2f} |", flush=True)
    finally:
        sys.setswitchinterval(own)


if __name__ == "__main__":
    main()
