"""Schemathesis against the frontend's own OpenAPI document (GET /openapi.json): generated
requests, valid and invalid, to every operation never get a 5xx or a status the document does
not list, and leave the workers with every KV block free."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.e2e.disagg_probe import wait_idle
from tests.e2e.topology import Topology

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def test_frontend_api(fuzz_topology: Topology) -> None:
    # Schemathesis's pytest plugin (from_fixture) does not run on this pytest; the schema's
    # strategies under plain hypothesis do the same.
    schema = schemathesis.openapi.from_url(fuzz_topology.http_url + "/openapi.json")
    statuses: list[int] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
        "POST /v1/responses", "GET /v1/responses/{response_id}",
        "DELETE /v1/responses/{response_id}", "POST /v1/messages",
        "POST /v1/messages/count_tokens", "POST /v1/embeddings"}
    for operation in operations:
        @FUZZ
        @given(case=operation.as_strategy(), real_model=st.booleans())
        def fuzz(case: schemathesis.Case, real_model: bool) -> None:
            if real_model and isinstance(case.body, dict):
                case.body["model"] = fuzz_topology.model  # past the model check, deeper in
            statuses.append(case.call_and_validate(base_url=fuzz_topology.http_url, timeout=30,
                                   checks=[not_a_server_error, status_code_conformance]
                                   ).status_code)

        fuzz()
    assert {200, 400, 404} <= set(statuses), sorted(set(statuses))


def test_no_leak_after_fuzzing(fuzz_topology: Topology) -> None:
    wait_idle(*fuzz_topology.decode_addresses, *fuzz_topology.prefill_addresses, timeout_s=10)
