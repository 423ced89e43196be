"""`tandem status` against a real `tandem up` topology: right after READY every worker is a
routing candidate; a worker whose engine stalls shows as not a candidate because its health is
NOT_SERVING, one that is killed because it is unreachable; an address where no router listens
ends in one line and a non-zero exit."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import grpc

from tandem.routing.snapshot import WorkerSnapshot
from tandem.runtime.router_status import RouterStatusClient
from tests.e2e.disagg_probe import child_pid, generate
from tests.e2e.topology import ROOT, free_ports, start_topology, tandem_cmd

#: How long the router may take to see a worker's health change (its streams report at once;
#: the bound only keeps a broken run from hanging).
SEE_CHANGE_S = 30


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(tandem_cmd("status", *args), cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def wait_worker(router: str, worker_id: str, until: str) -> WorkerSnapshot:
    """The router's view of `worker_id` once its reason contains `until` (checked each time the
    router answers, at most every 50 ms)."""
    async def poll() -> WorkerSnapshot:
        async with RouterStatusClient(router) as client:
            deadline = time.monotonic() + SEE_CHANGE_S
            while True:
                pools = await client.list_workers()
                (worker,) = [w for p in pools for w in p.workers if w.worker_id == worker_id]
                if until in worker.reason:
                    return worker
                assert time.monotonic() < deadline, worker
                await asyncio.sleep(0.05)
    return asyncio.run(poll())


def rows(table: str) -> dict[str, str]:
    """Worker table rows by worker id (the third column); the launcher's services follow the
    worker table after a blank line."""
    workers = table.split("\n\n")[0]
    return {line.split()[2]: line for line in workers.splitlines()[2:]}


def services(table: str) -> dict[str, list[str]]:
    """The launcher's service rows (after the worker table) by service name."""
    _, launcher = table.split("\n\n")
    return {line.split()[0]: line.split() for line in launcher.splitlines()[2:]}


def stuck_request(address: str) -> None:
    """A request the stalled engine holds; it fails when the worker is killed."""
    with contextlib.suppress(grpc.RpcError):
        generate(address, "stuck", [1, 2, 3], max_tokens=5)


def test_status_lists_every_worker_and_why_one_is_not_a_candidate() -> None:
    # Each worker says which GPUs it was given (the mock engine computes on none of them).
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--progress-timeout-s",
                          "1", "--debug-hooks", num_decode=2, env={"CUDA_VISIBLE_DEVICES": "3"})
    stalled, other = topo.decode_addresses
    try:
        # READY means every worker of every pool is a candidate: no wait here.
        table = status("--router-address", topo.router_address)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0] == (f"router {topo.router_address}: 1 pool(s), 2 worker(s), "
                            "2 candidate(s)")
        assert lines[1].split()[:5] == ["POOL", "KIND", "WORKER", "ADDRESS", "CANDIDATE"]
        # The local `tandem up` lists its processes too (it restarts none here: the topology
        # runs with --restart-policy no).
        assert set(services(table.stdout)) == {"decode-0", "decode-1", "router", "frontend"}
        assert all(row[2:4] == ["running", "0"] for row in services(table.stdout).values())
        for address in topo.decode_addresses:
            row = rows(table.stdout)[address].split()
            assert row[:6] == ["decode", "decode", address, address, "yes", "0"]
            # KV used/total (%) and running/waiting, as the worker reported them; what it
            # served (no prefill, no KV leased nor read yet) and its GPUs.
            assert row[6].startswith("0/") and row[7:9] == ["(0%)", "0/0"]
            assert row[9:15] == ["0", "0", "B", "0", "B", "3"]
        listed = json.loads(status("--router-address", topo.router_address, "--json").stdout)
        (pool,) = listed["pools"]
        assert (pool["name"], pool["kind"]) == ("decode", "decode")
        assert [(w["worker_id"], w["candidate"], w["health"], w["events_connected"])
                for w in pool["workers"]] == [(a, True, "serving", True)
                                               for a in topo.decode_addresses]
        assert all(w["last_load"]["kv_blocks_total"] > 0 for w in pool["workers"])
        assert all(w["last_load"]["devices"] == [{"id": "3", "name": ""}]
                   and w["last_load"]["served"]["kv_reads_ok"] == 0 for w in pool["workers"])

        # Stall one engine with work queued: its worker turns NOT_SERVING.
        pid = child_pid(topo.process.pid, int(stalled.rsplit(":", 1)[1]))
        os.kill(pid, signal.SIGUSR1)
        threading.Thread(target=stuck_request, args=(stalled,), daemon=True).start()
        seen = wait_worker(topo.router_address, stalled, "health NOT_SERVING")
        assert not seen.candidate and seen.events_connected
        table = status("--router-address", topo.router_address)
        assert table.stdout.splitlines()[0].endswith("2 worker(s), 1 candidate(s)")
        assert rows(table.stdout)[stalled].split()[4] == "no"
        assert rows(table.stdout)[stalled].endswith("  health NOT_SERVING")
        assert rows(table.stdout)[other].split()[4] == "yes"

        # Killed: unreachable, and the router says so.
        os.kill(pid, signal.SIGKILL)
        seen = wait_worker(topo.router_address, stalled, "unreachable")
        listed = json.loads(status("--router-address", topo.router_address, "--json").stdout)
        worker = {w["worker_id"]: w for w in listed["pools"][0]["workers"]}[stalled]
        assert worker["candidate"] is False and worker["health"] == "unreachable"
        assert worker["reason"].startswith("unreachable (UNAVAILABLE")
    finally:
        topo.stop()


def test_status_without_a_router_exits_with_one_line() -> None:
    (port,) = free_ports(1)
    result = status("--router-address", f"127.0.0.1:{port}", "--timeout-s", "5")
    assert result.returncode == 1 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"tandem status: router 127.0.0.1:{port} unavailable: ")
