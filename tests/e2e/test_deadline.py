"""A request past the frontend's deadline ends in 504 and frees its blocks on the worker."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.topology import start_topology
from tests.e2e.worker_probe import LoadWatcher


def test_request_past_its_deadline_is_504_and_aborted() -> None:
    # ~30 ms per step: 400 tokens need ~12 s, the deadline is 1 s.
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0.2",
                          "--request-timeout-s", "1")
    watcher = LoadWatcher(topo.decode_addresses[0])
    client = openai.OpenAI(base_url=topo.http_url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=topo.model, max_tokens=400,
                                           messages=[{"role": "user", "content": "slow"}],
                                           extra_body={"ignore_eos": True})
        assert info.value.status_code == 504
        assert info.value.body["type"] == "timeout"
        watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0,
                         timeout=5)
        quick = client.chat.completions.create(model=topo.model, max_tokens=3,
                                               messages=[{"role": "user", "content": "fast"}])
        assert quick.usage.completion_tokens == 3
    finally:
        watcher.close()
        assert topo.stop() == 0


def test_a_request_s_own_timeout_ends_in_504_and_frees_its_blocks() -> None:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0.2")  # no frontend timeout
    watcher = LoadWatcher(topo.decode_addresses[0])
    client = openai.OpenAI(base_url=topo.http_url + "/v1", api_key="x", max_retries=0)
    slow = {"model": topo.model, "max_tokens": 400,
            "messages": [{"role": "user", "content": "slow"}]}
    try:
        for extra in ({"extra_body": {"ignore_eos": True, "timeout": 1.0}},
                      {"extra_body": {"ignore_eos": True},
                       "extra_headers": {"x-request-timeout-ms": "1000"}}):
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(**slow, **extra)
            assert info.value.status_code == 504
            watcher.wait_for(lambda load: load.num_running == 0 and load.num_waiting == 0,
                             timeout=5)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**slow, extra_headers={"x-request-timeout-ms": "0"})
        assert bad.value.body["param"] == "x-request-timeout-ms"
    finally:
        watcher.close()
        assert topo.stop() == 0
