"""Overload reaches the client as 429 with Retry-After, not as a hang: a full worker queue, and
a burst beyond the frontend's own admission limits."""
from __future__ import annotations

import json
import pathlib
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.disagg_probe import child_pid, stats, wait_idle
from tests.e2e.topology import start_topology
from tests.e2e.worker_probe import LoadWatcher


def post_json(url: str, body: bytes) -> tuple[int, dict, dict]:
    """POSTs a JSON body: (HTTP status, headers, JSON reply), error statuses included."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_full_queue_answers_429_with_retry_after() -> None:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "1", "--max-batch-size", "1",
                          "--max-queued-requests", "1")
    watcher = LoadWatcher(topo.decode_addresses[0])
    body = json.dumps({"model": topo.model, "max_tokens": 400, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "take your time"}]}).encode()

    def post() -> tuple[int, dict, dict]:
        return post_json(topo.http_url + "/v1/chat/completions", body)

    try:
        results: list[tuple[int, dict, dict]] = []
        workers = [threading.Thread(target=lambda: results.append(post())) for _ in range(2)]
        workers[0].start()
        watcher.wait_for(lambda load: load.num_running == 1)
        workers[1].start()
        watcher.wait_for(lambda load: load.num_waiting == 1)
        status, headers, reply = post()  # the third: nowhere to queue it
        assert status == 429, reply
        assert headers.get("Retry-After") == "1"
        assert reply["error"]["type"] == "rate_limit_error"
        for t in workers:
            t.join(60)
        assert [r[0] for r in results] == [200, 200]  # the accepted ones complete
        assert all(r[2]["usage"]["completion_tokens"] == 400 for r in results)
    finally:
        watcher.close()
        assert topo.stop() == 0


def _rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for pid {pid}")


def test_burst_beyond_frontend_capacity_gets_429_and_frees_everything() -> None:
    """Frontend admission control: 4 requests in flight and 4 queued at most; a burst of 48
    gets clear 429s for the rest, the accepted ones complete, and the pool ends as it began."""
    topo = start_topology("--engine", "mock", "--speedup-ratio", "1",
                          "--frontend-max-inflight-requests", "4",
                          "--frontend-max-queued-requests", "4")
    worker = topo.decode_addresses[0]
    http_port = int(topo.http_url.rsplit(":", 1)[1])
    try:
        start_blocks = stats(worker)
        frontend_pid = child_pid(topo.process.pid, http_port, flag=b"--http-port")
        rss_before = _rss_bytes(frontend_pid)
        body = json.dumps({"model": topo.model, "max_tokens": 40, "ignore_eos": True,
                           "prompt": "burst " * 50}).encode()

        def post(_: int) -> tuple[int, dict, dict]:
            return post_json(topo.http_url + "/v1/completions", body)

        with ThreadPoolExecutor(48) as pool:
            results = list(pool.map(post, range(48)))
        statuses = sorted(r[0] for r in results)
        assert set(statuses) == {200, 429}, statuses
        refused = [r for r in results if r[0] == 429]
        accepted = [r for r in results if r[0] == 200]
        assert len(refused) >= 24 and len(accepted) >= 8, statuses
        assert all(h.get("Retry-After") == "1" and b["error"]["type"] == "rate_limit_error"
                   for _, h, b in refused)
        assert all(b["usage"]["completion_tokens"] == 40 for _, _, b in accepted)
        wait_idle(worker)
        end_blocks = stats(worker)
        assert end_blocks.kv_blocks_used == start_blocks.kv_blocks_used == 0
        assert end_blocks.num_running == end_blocks.num_waiting == 0
        assert _rss_bytes(frontend_pid) - rss_before < 100 * 1024 * 1024
    finally:
        assert topo.stop() == 0
