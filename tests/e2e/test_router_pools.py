"""The router across pools and inside a pool, through the whole stack (real processes):
the grid sends each request to the pool its prompt length and TTFT target call for; the KV
policy sends a shared prefix back to the worker that holds it, and still spreads load."""
from __future__ import annotations

import collections
import json
import pathlib
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.topology import Topology, free_ports, start_topology

# Agg grid over prompt length x TTFT target x ITL target: short prompts with a tight TTFT go to
# the fast pool (0); anything long or relaxed goes to the slow pool (1).
GRID = {
    "mode": "agg",
    "num_agg_pools": 2,
    "agg_pool_selection_strategy": {
        "isl_min": 0, "isl_max": 400, "isl_resolution": 2,
        "ttft_min_ms": 0, "ttft_max_ms": 1000, "ttft_resolution": 2,
        "itl_min_ms": 0, "itl_max_ms": 100, "itl_resolution": 1,
        "agg_pool_mapping": [[[0], [1]], [[1], [1]]],
    },
}


def completion(topo: Topology, tokens: list[int], headers: dict[str, str] | None = None,
               max_tokens: int = 4) -> tuple[dict[str, str], dict]:
    body = json.dumps({"model": topo.model, "prompt": tokens, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(topo.http_url + "/v1/completions", data=body, headers={
        "Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return dict(reply.headers), json.loads(reply.read())


def write_deployment(tmp: pathlib.Path, pools: list[dict], grid: dict | None = None,
                     metrics_port: int = 0) -> pathlib.Path:
    spec: dict = {"engine": "mock", "pools": pools, "router_metrics_port": metrics_port}
    if grid is not None:
        (tmp / "grid.json").write_text(json.dumps(grid))
        spec["grid_config"] = str(tmp / "grid.json")
    (tmp / "deploy.json").write_text(json.dumps(spec))  # JSON is YAML
    return tmp / "deploy.json"


@pytest.fixture(scope="module")
def grid_topology(tmp_path_factory: pytest.TempPathFactory):
    fast, slow = free_ports(2)
    spec = write_deployment(tmp_path_factory.mktemp("grid"), [
        {"name": "fast", "kind": "agg", "ports": [fast]},
        {"name": "slow", "kind": "agg", "ports": [slow]}], GRID)
    topo = start_topology("--config", str(spec), "--speedup-ratio", "0")
    yield topo
    assert topo.stop() == 0


@pytest.mark.parametrize("isl,ttft,pool", [
    (50, 100, "fast"),     # short, tight TTFT: cell (0, 0)
    (50, 900, "slow"),     # short, relaxed: cell (0, 1)
    (300, 100, "slow"),    # long: cell (1, 0)
    (1500, 100, "slow"),   # beyond isl_max: clamped to the last row
])
def test_grid_sends_requests_to_the_pool_it_names(grid_topology: Topology, isl: int, ttft: int,
                                                  pool: str) -> None:
    tokens = [(i * 13) % 3000 + 10 for i in range(isl)]
    headers, reply = completion(grid_topology, tokens, {"x-slo-ttft-ms": str(ttft)})
    assert headers["x-tandem-pool"] == pool
    assert reply["usage"]["completion_tokens"] == 4


def test_body_targets_win_over_headers(grid_topology: Topology) -> None:
    body = json.dumps({"model": grid_topology.model, "prompt": list(range(10, 60)),
                       "max_tokens": 2, "nvext": {"router": {"ttft_target": 100}}}).encode()
    request = urllib.request.Request(grid_topology.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "x-slo-ttft-ms": "900"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["x-tandem-pool"] == "fast"


@pytest.fixture(scope="module")
def kv_topology(tmp_path_factory: pytest.TempPathFactory):
    *ports, metrics = free_ports(5)
    spec = write_deployment(tmp_path_factory.mktemp("kv"), [
        {"name": "decode", "kind": "decode", "ports": ports, "policy": "kv"}],
        metrics_port=metrics)
    # Real-time step times, so that concurrent requests really overlap on the workers. The
    # router decides (no local routing): its metrics tell when it has seen a worker's blocks.
    topo = start_topology("--config", str(spec), "--speedup-ratio", "1", "--no-local-routing")
    topo.metrics_url = f"http://127.0.0.1:{metrics}/metrics"  # type: ignore[attr-defined]
    yield topo
    assert topo.stop() == 0


def router_view(topo: Topology, metric: str) -> dict[str, float]:
    with urllib.request.urlopen(topo.metrics_url, timeout=10) as reply:  # type: ignore[attr-defined]
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            worker = line.split('worker="')[1].split('"')[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


def wait_router_sees(topo: Topology, worker: str, blocks: int, timeout_s: float = 10) -> None:
    """The router learns a worker's blocks and idle load from its event stream, a few ms after
    the answer; its metrics are the only outside view of that, so poll them briefly."""
    done = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if (router_view(topo, "tandem_router_indexed_blocks").get(worker, 0) >= blocks
                and router_view(topo, "tandem_router_worker_active_requests").get(worker) == 0):
            return
        done.wait(0.05)
    raise AssertionError(f"router never saw {blocks} blocks of {worker} with the worker idle")


def test_kv_policy_sends_a_shared_prefix_to_its_holder(kv_topology: Topology) -> None:
    prefix = [(i * 7) % 3000 + 10 for i in range(320)]  # 10 blocks of 32
    headers, _ = completion(kv_topology, prefix)
    holder = headers["x-tandem-decode-worker"]
    wait_router_sees(kv_topology, holder, 10)
    for n in range(5):
        tokens = prefix[:288] + [3000 + n, 3001 + n, 3002 + n]
        headers, reply = completion(kv_topology, tokens)
        assert headers["x-tandem-decode-worker"] == holder
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256


def test_kv_policy_still_spreads_a_shared_system_prompt(kv_topology: Topology) -> None:
    system = [(i * 11) % 3000 + 10 for i in range(64)]  # 2 blocks every user shares

    def user(n: int) -> str:
        tokens = system + [(n * 37 + j) % 3000 + 10 for j in range(64)]
        headers, _ = completion(kv_topology, tokens, max_tokens=40)
        return headers["x-tandem-decode-worker"]

    with ThreadPoolExecutor(max_workers=16) as pool:
        served = collections.Counter(pool.map(user, range(48)))
    assert len(served) == 4, served  # every worker took some
    assert max(served.values()) <= 48 * 0.5, served  # nobody got (nearly) everything


def test_a_dead_pool_retries_on_the_faster_pool(tmp_path: pathlib.Path) -> None:
    import os
    import signal

    from tests.e2e.test_launcher import children_of

    fast, slow = free_ports(2)
    grid = {**GRID, "enable_priority_retry": True}
    spec = write_deployment(tmp_path, [{"name": "fast", "kind": "agg", "ports": [fast]},
                                       {"name": "slow", "kind": "agg", "ports": [slow]}], grid)
    topo = start_topology("--config", str(spec), "--speedup-ratio", "0")
    try:
        relaxed = {"x-slo-ttft-ms": "900"}
        headers, _ = completion(topo, list(range(10, 60)), relaxed)
        assert headers["x-tandem-pool"] == "slow"
        for pid in children_of(topo.process.pid):
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(slow).encode() in cmdline and b"decode" in cmdline:
                os.kill(pid, signal.SIGKILL)
        for n in range(3):  # nothing had streamed: each goes to the faster pool instead
            headers, reply = completion(topo, list(range(10 + n, 60 + n)), relaxed)
            assert headers["x-tandem-pool"] == "fast"
            assert reply["usage"]["completion_tokens"] == 4
    finally:
        topo.stop()
