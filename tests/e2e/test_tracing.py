"""Traces across processes: a disaggregated topology (mock engine) exports over real OTLP/gRPC to
a receiver in this test, configured only by the standard OTEL_* variables. One request yields one
trace whose spans come from frontend, router, prefill and decode and nest as the calls do."""
from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.e2e.topology import Topology, free_ports, start_topology

SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: tuple[str, ...]


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.arrived = threading.Condition()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.arrived:
            for resource_spans in request.resource_spans:
                service = next(_value(a.value) for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans.extend(Span(
                        str(service), s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                        tuple(e.name for e in s.events))
                        for s in scope.spans)
            self.arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, trace_id: str, expected: set[tuple[str, str]],
                 timeout_s: float = 30) -> list[Span]:
        """The trace's spans once every (service, span name) in `expected` arrived."""
        def trace() -> list[Span]:
            return [s for s in self.spans if s.trace_id == trace_id]

        def missing() -> set[tuple[str, str]]:
            return expected - {(s.service, s.name) for s in trace()}

        with self.arrived:
            if not self.arrived.wait_for(lambda: not missing(), timeout_s):
                raise AssertionError(f"spans never arrived: {missing()}")
            return trace()


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[Topology, Receiver]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    (port,) = free_ports(1)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    # The router service decides (no local routing), so its Route span joins the trace.
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--no-local-routing",
                          num_prefill=1, env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "50"})
    yield topo, receiver
    assert topo.stop() == 0
    server.stop(None)


def completion(topo: Topology, prompt: list[int], max_tokens: int,
               headers: dict[str, str]) -> dict:
    body = {"model": topo.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    request = urllib.request.Request(topo.http_url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def one(spans: list[Span], service: str, name: str, kind: int | None = None) -> Span:
    found = [s for s in spans if s.service == service and s.name == name
             and (kind is None or s.kind == kind)]
    assert len(found) == 1, (service, name, found)
    return found[0]


def test_a_disaggregated_request_is_one_trace_across_services(
        traced: tuple[Topology, Receiver]) -> None:
    topo, receiver = traced
    trace_id, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    prompt = list(range(10, 110))
    reply = completion(topo, prompt, 6, {"traceparent": f"00-{trace_id}-{caller_span}-01"})
    spans = receiver.wait_for(trace_id, {
        ("tandem-frontend", "POST /v1/completions"), ("tandem-frontend", "tokenize"),
        ("tandem-router", "tandem.v1.Router/Route"), ("tandem-prefill", "tandem.v1.Prefill/Prefill"),
        ("tandem-decode", "tandem.v1.Decode/Generate"), ("tandem-decode", "kv_transfer"),
        ("tandem-prefill", "tandem.v1.Prefill/Release")})
    assert {s.service for s in spans} == {"tandem-frontend", "tandem-router", "tandem-prefill",
                                          "tandem-decode"}

    # The frontend's request span continues the caller's trace and carries GenAI attributes.
    root = one(spans, "tandem-frontend", "POST /v1/completions", SERVER)
    assert root.parent_id == caller_span
    assert root.attributes["gen_ai.request.model"] == topo.model
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"] == 100
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["http.response.status_code"] == 200
    assert one(spans, "tandem-frontend", "tokenize").parent_id == root.span_id

    # Each call: a client span under the request span, the callee's server span under it.
    for service, name in (("tandem-router", "tandem.v1.Router/Route"),
                          ("tandem-prefill", "tandem.v1.Prefill/Prefill"),
                          ("tandem-decode", "tandem.v1.Decode/Generate")):
        client = one(spans, "tandem-frontend", name, CLIENT)
        assert client.parent_id == root.span_id
        assert one(spans, service, name, SERVER).parent_id == client.span_id

    decode = one(spans, "tandem-decode", "tandem.v1.Decode/Generate", SERVER)
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    assert decode.events == ("first_token",)  # when the worker sent it: TTFT's split
    # The KV read runs in an engine task, yet belongs to the decode call's span.
    transfer = one(spans, "tandem-decode", "kv_transfer")
    assert transfer.parent_id == decode.span_id
    assert transfer.attributes["tandem.kv.bytes"] == 4 * 2 * 2 * 32 * 2 * 16 * 4  # 4 blocks
    assert one(spans, "tandem-prefill", "tandem.v1.Prefill/Release").parent_id == decode.span_id
    route = one(spans, "tandem-router", "tandem.v1.Router/Route", SERVER)
    assert route.attributes["tandem.route.disaggregate"] is True


def test_a_request_without_trace_context_starts_its_own_trace(
        traced: tuple[Topology, Receiver]) -> None:
    topo, receiver = traced
    before = {s.trace_id for s in receiver.spans}
    completion(topo, list(range(500, 540)), 2, {})
    with receiver.arrived:
        assert receiver.arrived.wait_for(lambda: any(
            s.name == "POST /v1/completions" and s.trace_id not in before
            for s in receiver.spans), 30)
        root = next(s for s in receiver.spans
                    if s.name == "POST /v1/completions" and s.trace_id not in before)
    assert root.parent_id == ""
    receiver.wait_for(root.trace_id, {("tandem-router", "tandem.v1.Router/Route"),
                                      ("tandem-decode", "tandem.v1.Decode/Generate")})


def test_each_engine_step_is_a_span(traced: tuple[Topology, Receiver]) -> None:
    """Workers trace their engine's steps (a span each, in a trace of its own): the prefill
    worker's step that computed a new prompt and gave its first token, the decode worker's
    steps that then streamed it."""
    topo, receiver = traced
    completion(topo, list(range(300, 361)), 4, {})  # 61 prompt tokens nobody cached

    def steps(service: str) -> list[dict]:
        return [s.attributes for s in receiver.spans
                if s.service == service and s.name == "engine.step"]

    with receiver.arrived:
        assert receiver.arrived.wait_for(lambda: any(
            a["tandem.step.prefill_tokens"] == 61 for a in steps("tandem-prefill")), 30)
        assert receiver.arrived.wait_for(lambda: any(
            a["tandem.step.first_tokens"] >= 1 and a["tandem.step.prefill_tokens"] == 0
            for a in steps("tandem-decode")), 30)
    prefill = next(a for a in steps("tandem-prefill") if a["tandem.step.prefill_tokens"] == 61)
    assert prefill["tandem.step.admitted"] == 1 and prefill["tandem.step.first_tokens"] == 1
    assert any(a["tandem.step.scheduled"] >= 1 and a["tandem.step.prefill_tokens"] == 0
               for a in steps("tandem-decode"))  # its decode steps
