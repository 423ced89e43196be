"""A full worker queue reaches the client as 429 with Retry-After, not as a hang."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

from tests.e2e.topology import start_topology
from tests.e2e.worker_probe import LoadWatcher


def test_full_queue_answers_429_with_retry_after() -> None:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "1", "--max-batch-size", "1",
                          "--max-queued-requests", "1")
    watcher = LoadWatcher(topo.decode_addresses[0])
    body = json.dumps({"model": topo.model, "max_tokens": 400, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "take your time"}]}).encode()

    def post() -> tuple[int, dict, dict]:
        request = urllib.request.Request(topo.http_url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, dict(reply.headers), json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

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
