"""A client that goes away mid-stream cancels the request all the way down to the engine."""
from __future__ import annotations

import http.client
import json
import urllib.parse

from tests.e2e.topology import Topology
from tests.e2e.worker_probe import LoadWatcher


def test_disconnect_aborts_engine_request_and_frees_blocks(slow_topology: Topology) -> None:
    topo = slow_topology
    watcher = LoadWatcher(topo.decode_addresses[0])
    try:
        idle = watcher.wait_for(lambda load: load.num_running == 0 and load.kv_blocks_total > 0)
        url = urllib.parse.urlparse(topo.http_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        body = {"model": topo.model, "stream": True, "max_tokens": 1500, "ignore_eos": True,
                "messages": [{"role": "user", "content": "a long answer " * 20}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        events = 0
        while events < 5:  # a few tokens have streamed: the request is running
            line = response.fp.readline()
            events += line.startswith(b"data: ")
        busy = watcher.wait_for(lambda load: load.num_running == 1)
        assert busy.kv_blocks_used > idle.kv_blocks_used
        conn.sock.close()  # the client goes away mid-stream
        conn.close()
        freed = watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0
                                 and load.kv_blocks_used == idle.kv_blocks_used)
        assert freed.kv_blocks_used == idle.kv_blocks_used
    finally:
        watcher.close()
