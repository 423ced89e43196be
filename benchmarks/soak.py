"""Soak: minutes of mixed traffic against a running Tandem, then proof that nothing leaked.

The mix, from `--clients` concurrent clients: complete answers (streamed and not), streams the
client abandons after a few chunks, and bad requests (broken JSON, unknown model, out-of-range
values). Every answer must be a 200 or the 4xx its request deserves (429 counts as a clean
refusal); a 5xx or a broken connection is an error. At the start (after a warm-up) and at the
end, it prints the resident memory of every Tandem process and the free KV blocks of every
worker; once the traffic stops, the free blocks must be back at their starting level.

    python -m benchmarks.soak --duration-s 600      # starts `tandem up --engine mock`
    python -m benchmarks.soak --duration-s 600 -- --speedup-ratio 0.5

Linux only (reads /proc).
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from benchmarks._procstats import descendants, label_processes
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.topology import free_ports

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: What each kind of request may be answered with; anything else is an error.
EXPECTED = {
    "complete": {200, 429},
    "stream": {200, 429},
    "abandoned": {200, 429},
    "bad": {400, 404, 413},
}
WEIGHTS = {"complete": 3, "stream": 3, "abandoned": 2, "bad": 2}
BAD_BODIES: list[bytes | Callable[[str], bytes]] = [
    b"{not json",
    b"[]",
    lambda model: json.dumps({"model": model + "-nope", "prompt": "x"}).encode(),
    lambda model: json.dumps({"model": model, "prompt": "x", "max_tokens": -1}).encode(),
    lambda model: json.dumps({"model": model, "prompt": "x", "temperature": "hot"}).encode(),
    lambda model: json.dumps({"model": model, "messages": []}).encode(),
    lambda model: json.dumps({"model": model, "prompt": [10**9]}).encode(),
]


@dataclass
class Snapshot:
    #: Resident memory of each Tandem process, bytes, by name.
    rss: dict[str, int]
    #: Free KV blocks of each worker, by address.
    free_blocks: dict[str, int]


@dataclass
class SoakReport:
    duration_s: float
    start: Snapshot
    end: Snapshot
    #: (kind, status) -> count; status -1: the connection broke.
    outcomes: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)

    def rss_growth(self) -> dict[str, int]:
        return {name: self.end.rss[name] - rss for name, rss in self.start.rss.items()
                if name in self.end.rss}

    def render(self) -> str:
        lines = [f"soak: {sum(self.outcomes.values())} requests in {self.duration_s:.0f} s, "
                 f"{len(self.errors)} errors"]
        for (kind, status), n in sorted(self.outcomes.items()):
            lines.append(f"  {kind:<10} {status:>4}  {n}")
        lines.append(f"  {'process':<24} {'RSS start MiB':>14} {'RSS end MiB':>12}")
        for name, rss in sorted(self.start.rss.items()):
            end = self.end.rss.get(name, 0)
            lines.append(f"  {name:<24} {rss / 2**20:>14.1f} {end / 2**20:>12.1f}")
        lines.append(f"  {'worker':<24} {'free blocks start':>18} {'end':>6}")
        for address, free in sorted(self.start.free_blocks.items()):
            lines.append(f"  {address:<24} {free:>18} {self.end.free_blocks.get(address, -1):>6}")
        lines += [f"  error: {e}" for e in self.errors[:10]]
        return "\n".join(lines)


def rss_bytes(pid: int) -> int | None:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def worker_stats(address: str) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)


def snapshot(launcher_pid: int, workers: Sequence[str]) -> Snapshot:
    """Free blocks once the workers are idle, then every Tandem process's resident memory."""
    blocks = idle_free_blocks(workers)
    tandem = descendants(launcher_pid)
    rss = {name: value for pid, name in label_processes(launcher_pid).items()
           if pid in tandem and (value := rss_bytes(pid)) is not None}
    return Snapshot(rss, blocks)


class Client:
    """One client thread's requests, each on its own connection (as many clients do)."""

    def __init__(self, http_url: str, model: str, seed: int) -> None:
        url = urllib.parse.urlsplit(http_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.model = model
        self.rng = random.Random(seed)

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=60)

    def one(self) -> tuple[str, int]:
        kinds, weights = zip(*WEIGHTS.items(), strict=True)
        kind = self.rng.choices(kinds, weights)[0]
        rng = self.rng
        if kind == "bad":
            body = rng.choice(BAD_BODIES)
            return kind, self._post("/v1/completions",
                                    body(self.model) if callable(body) else body, None)
        request = {"model": self.model, "max_tokens": rng.randint(1, 64),
                   "ignore_eos": rng.random() < 0.5, "stream": kind != "complete",
                   "temperature": rng.choice([0.0, 0.7, 1.0])}
        if rng.random() < 0.5:
            request["messages"] = [{"role": "user", "content": "soak " * rng.randint(1, 200)}]
            path = "/v1/chat/completions"
        else:
            request["prompt"] = "soak " * rng.randint(1, 200)
            path = "/v1/completions"
        abandon_after = rng.randint(1, 3) if kind == "abandoned" else None
        return kind, self._post(path, json.dumps(request).encode(), abandon_after)

    def _post(self, path: str, body: bytes, abandon_after: int | None) -> int:
        conn = self._connection()
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            if abandon_after is None or reply.status != 200:
                reply.read()
                return reply.status
            for _ in range(abandon_after):  # a few SSE lines, then the client leaves
                if not reply.readline():
                    break
            return reply.status
        finally:
            conn.close()


def run_traffic(http_url: str, model: str, duration_s: float, num_clients: int,
                seed: int = 0) -> tuple[collections.Counter[tuple[str, int]], list[str]]:
    outcomes: collections.Counter[tuple[str, int]] = collections.Counter()
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def loop(i: int) -> None:
        client = Client(http_url, model, seed * 1000 + i)
        while time.monotonic() < stop_at:
            try:
                kind, status = client.one()
            except (OSError, http.client.HTTPException) as exc:
                kind, status = "broken", -1
                with lock:
                    errors.append(f"connection failed: {exc!r}")
            with lock:
                outcomes[kind, status] += 1
                if kind in EXPECTED and status not in EXPECTED[kind]:
                    errors.append(f"{kind} request answered {status}")

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, errors


def idle_free_blocks(workers: Sequence[str], timeout_s: float = 30) -> dict[str, int]:
    """The workers' free KV blocks once none runs or queues a request (abandoned streams are
    freed asynchronously), or as they stand at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {address: worker_stats(address) for address in workers}
        if all(not (s.num_running or s.num_waiting or s.num_loading or s.kv_leases)
               for s in loads.values()) or time.monotonic() > deadline:
            return {address: s.kv_blocks_total - s.kv_blocks_used
                    for address, s in loads.items()}
        time.sleep(0.1)


def soak(http_url: str, model: str, launcher_pid: int, workers: Sequence[str],
         duration_s: float, num_clients: int = 8, warmup_s: float = 3.0,
         seed: int = 0) -> SoakReport:
    """Warm-up traffic, a start snapshot, `duration_s` of traffic, an end snapshot (each
    snapshot once the workers are idle)."""
    _, warmup_errors = run_traffic(http_url, model, warmup_s, num_clients, seed + 1)
    start = snapshot(launcher_pid, workers)
    began = time.monotonic()
    outcomes, errors = run_traffic(http_url, model, duration_s, num_clients, seed)
    elapsed = time.monotonic() - began
    end = snapshot(launcher_pid, workers)
    return SoakReport(elapsed, start, end, outcomes, warmup_errors + errors)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--num-decode", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("tandem_args", nargs="*", help="extra `tandem up` flags (after --)")
    args = parser.parse_args(argv)
    http_port, grpc_port, router_port, *decode = free_ports(3 + args.num_decode)
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--engine", "mock", "--http-port",
           str(http_port), "--grpc-port", str(grpc_port), "--router-port", str(router_port),
           "--decode-ports", *map(str, decode), "--grace-period-s", "5", *args.tandem_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        ready = next((line for line in proc.stdout if line.startswith("READY ")), None)
        if ready is None:
            print("tandem up exited before it was ready", file=sys.stderr)
            return 1
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        fields = dict(item.split("=", 1) for item in ready.split()[1:])
        report = soak(fields["http"], fields["model"], proc.pid,
                      [f"127.0.0.1:{p}" for p in decode], args.duration_s, args.clients,
                      seed=args.seed)
        print(report.render(), flush=True)
        leaked = report.end.free_blocks != report.start.free_blocks
        return 1 if report.errors or leaked else 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
