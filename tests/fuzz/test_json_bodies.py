"""Arbitrary JSON against the OpenAI routes of a running topology (mock engine): any value in
any field, bodies that are not objects, not JSON or nested thousands of levels deep, each get a
2xx or a 4xx with OpenAI's error JSON, never a 5xx, and the frontend stays up."""
from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.frontend.json_body import MAX_JSON_DEPTH
from tandem.frontend.request_fields import IGNORED, REFUSED
from tests.e2e.disagg_probe import wait_idle
from tests.e2e.topology import Topology

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
#: Every field either route reads, refuses or ignores, and a few no server knows.
FIELDS = sorted({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "reasoning_effort",
    "chat_template_kwargs", "ignore_eos", "min_tokens", "skip_special_tokens", "nvext",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "best_of",
    *(r.name for r in REFUSED), *(k.split(".")[0] for k in IGNORED), "x", "__proto__"})
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False) | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


def _base(topo: Topology, route: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": topo.model, "max_tokens": 4}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


def _post(topo: Topology, route: str, content: bytes) -> requests.Response:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    return requests.post(topo.http_url + path, data=content, timeout=30,
                         headers={"content-type": "application/json"})


def _check(response: requests.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_any_value_in_any_field_is_answered_without_a_server_error(fuzz_topology: Topology,
                                                                   route: str) -> None:
    @FUZZ
    @given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON, min_size=1, max_size=3))
    def fuzz(fields: dict[str, Any]) -> None:
        body = {**_base(fuzz_topology, route), **fields}
        _check(_post(fuzz_topology, route, json.dumps(body).encode()))

    fuzz()
    wait_idle(*fuzz_topology.decode_addresses, *fuzz_topology.prefill_addresses, timeout_s=10)


@FUZZ
@given(raw=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_bodies_that_are_not_requests_get_a_400(fuzz_topology: Topology, raw: bytes) -> None:
    response = _post(fuzz_topology, "chat", raw)
    _check(response)
    assert response.status_code in (400, 404), response.text[:300]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 100_000])
@pytest.mark.parametrize("where", ["body", "schema"])
def test_deep_nesting_is_a_400_that_says_so(fuzz_topology: Topology, depth: int,
                                            where: str) -> None:
    nested = "[" * depth + "]" * depth
    body = json.dumps(_base(fuzz_topology, "chat"))[:-1]
    if where == "body":
        text = body + f', "x": {nested}}}'
    else:  # inside a json_schema: walked by the grammar compiler if it got through
        text = body + (', "response_format": {"type": "json_schema", "json_schema": {"name": '
                       f'"s", "schema": {{"type": "object", "default": {nested}}}}}}}}}')
    response = _post(fuzz_topology, "chat", text.encode())
    assert response.status_code == 400, response.text[:300]
    assert f"deeper than {MAX_JSON_DEPTH} levels" in response.json()["error"]["message"]


def test_an_empty_web_search_options_object_is_refused(fuzz_topology: Topology) -> None:
    for value in ({}, {"search_context_size": "low"}):
        body = {**_base(fuzz_topology, "chat"), "web_search_options": value}
        response = _post(fuzz_topology, "chat", json.dumps(body).encode())
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "web_search_options"
    body = {**_base(fuzz_topology, "chat"), "web_search_options": None}
    assert _post(fuzz_topology, "chat", json.dumps(body).encode()).status_code == 200
