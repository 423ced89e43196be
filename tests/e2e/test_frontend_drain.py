"""SIGTERM to the frontend: the stream in flight finishes, new requests are refused, exit 0."""
from __future__ import annotations

import os
import pathlib
import signal
import threading

import openai
import pytest

from tests.e2e.test_launcher import children_of
from tests.e2e.topology import start_topology


def _frontend_pid(launcher_pid: int) -> int:
    for pid in children_of(launcher_pid):
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"frontend" in cmdline:
            return pid
    raise AssertionError("no frontend process")


def test_sigterm_drains_the_frontend() -> None:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0.2")
    client = openai.OpenAI(base_url=topo.http_url + "/v1", api_key="x", max_retries=0)
    try:
        stream = client.chat.completions.create(
            model=topo.model, messages=[{"role": "user", "content": "drain me"}],
            max_tokens=60, stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(chunks)  # streaming has started (~2 s of steps remain)
        frontend = _frontend_pid(topo.process.pid)
        rest: list = []
        reader = threading.Thread(target=lambda: rest.extend(chunks))
        reader.start()
        os.kill(frontend, signal.SIGTERM)
        reader.join(30)
        assert rest[-1].usage.completion_tokens == 60  # the stream in flight finished
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
            client.chat.completions.create(model=topo.model, max_tokens=2,
                                           messages=[{"role": "user", "content": "late"}])
    finally:
        topo.stop()
