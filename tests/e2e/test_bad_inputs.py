"""Bad inputs get the right HTTP status and an OpenAI-shaped error; the services stay up."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.e2e.topology import Topology


def post(topology: Topology, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(topology.http_url + path, data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(model: str, **overrides: object) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(overrides)
    return json.dumps({k: v for k, v in body.items() if v is not Ellipsis}).encode()


CASES = [
    ("invalid JSON", lambda m: b'{"model": "x", "messages": [', 400, None),
    ("not an object", lambda m: b"[1, 2]", 400, None),
    ("missing messages", lambda m: chat(m, messages=...), 400, "messages"),
    ("empty messages", lambda m: chat(m, messages=[]), 400, "messages"),
    ("unknown model", lambda m: chat("no-such-model"), 404, "model"),
    ("max_tokens zero", lambda m: chat(m, max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", lambda m: chat(m, max_tokens=-5), 400, "max_tokens"),
    ("max_tokens a string", lambda m: chat(m, max_tokens="ten"), 400, "max_tokens"),
    ("temperature a string", lambda m: chat(m, temperature="hot"), 400, "temperature"),
    ("messages not a list", lambda m: chat(m, messages="hello"), 400, "messages"),
    ("content a number", lambda m: chat(m, messages=[{"role": "user", "content": 5}]), 400, None),
    ("n beyond the limit", lambda m: chat(m, n=17), 400, "n"),
    ("prompt longer than the context",
     lambda m: chat(m, messages=[{"role": "user", "content": "word " * 5000}]), 400, None),
    ("max_tokens beyond the context", lambda m: chat(m, max_tokens=10**6), 400, "max_tokens"),
]


@pytest.mark.parametrize("name,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(topology: Topology, name: str, body, status: int, param: str | None) -> None:
    code, reply = post(topology, "/v1/chat/completions", body(topology.model))
    assert code == status, reply
    error = reply["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"]
    if param is not None:
        assert error["param"] == param


def test_unknown_route_is_an_openai_error(topology: Topology) -> None:
    code, reply = post(topology, "/v1/nothing-here", b"{}")
    assert code == 404 and reply["error"]["message"]


def test_services_stay_up_after_bad_inputs(topology: Topology) -> None:
    for _, body, _, _ in CASES:
        post(topology, "/v1/chat/completions", body(topology.model))
    client = openai.OpenAI(base_url=topology.http_url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model=topology.model, max_tokens=3,
                                           messages=[{"role": "user", "content": "still up?"}])
    assert reply.usage.completion_tokens == 3
    with urllib.request.urlopen(topology.http_url + "/health", timeout=10) as health:
        assert health.status == 200


def test_oversized_body_is_413_in_openai_shape(topology: Topology) -> None:
    filler = "x" * (33 * 1024 * 1024)  # over the 32 MiB default limit
    code, reply = post(topology, "/v1/chat/completions", chat(topology.model, user=filler))
    assert code == 413, reply
    assert reply["error"]["message"]
