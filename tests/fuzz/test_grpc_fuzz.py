"""Hypothesis-generated protobuf messages against every gRPC service of a running topology
(frontend, router, prefill and decode workers; mock engine): each call ends with OK or a
clean, typed status (never INTERNAL or UNKNOWN, never a hang), every process stays up, and the
workers end with no KV block, lease or read left."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    kv_events_pb2,
    kv_events_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.e2e.disagg_probe import stats, wait_idle
from tests.e2e.topology import Topology, wait_serving
from tests.fuzz.protobuf_strategies import messages

#: A bug, not an answer: an unhandled exception (the interceptor's INTERNAL), an unknown
#: failure, or a call that never ended.
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.DEADLINE_EXCEEDED}
CALL_TIMEOUT_S = 20
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@dataclass
class Services:
    topo: Topology
    channels: dict[str, grpc.Channel]

    def channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address)
        return self.channels[address]


@pytest.fixture(scope="module")
def services(fuzz_topology: Topology) -> Iterator[Services]:
    s = Services(fuzz_topology, {})
    yield s
    for channel in s.channels.values():
        channel.close()


def _call(invoke: Callable[[], object]) -> grpc.StatusCode:
    """Runs one call (a unary reply, or a stream read to its end) and returns its status."""
    try:
        reply = invoke()
        if isinstance(reply, Iterator):
            for _ in reply:
                pass
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        assert code not in BAD_CODES, f"{code}: {exc.details()}"  # type: ignore[attr-defined]
        return code
    return grpc.StatusCode.OK


def _all_serving(s: Services) -> None:
    topo = s.topo
    assert topo.process.poll() is None
    for address in [topo.router_address, topo.grpc_address, *topo.decode_addresses,
                    *topo.prefill_addresses]:
        wait_serving(address)


def _no_leak(s: Services) -> None:
    _all_serving(s)
    wait_idle(*s.topo.decode_addresses, *s.topo.prefill_addresses, timeout_s=10)
    for address in [*s.topo.decode_addresses, *s.topo.prefill_addresses]:
        load = stats(address)
        assert load.num_running == load.num_waiting == 0, load


def _inference_requests(model: str) -> st.SearchStrategy[Message]:
    """Half of them name the served model, so that they get past the model check."""
    def name_model(pair: tuple[inference_pb2.InferenceRequest, bool]) -> Message:
        request, real = pair
        if real:
            request.model = model
        return request
    return st.tuples(messages(inference_pb2.InferenceRequest.DESCRIPTOR),
                     st.booleans()).map(name_model)


def test_inference_service(services: Services) -> None:
    stub = inference_pb2_grpc.InferenceStub(services.channel(services.topo.grpc_address))

    @FUZZ
    @given(_inference_requests(services.topo.model))
    def fuzz(request: inference_pb2.InferenceRequest) -> None:
        _call(lambda: stub.Generate(request, timeout=CALL_TIMEOUT_S))

    fuzz()
    _call(lambda: stub.ListModels(inference_pb2.ListModelsRequest(), timeout=CALL_TIMEOUT_S))
    _no_leak(services)


def test_router_service(services: Services) -> None:
    stub = router_pb2_grpc.RouterStub(services.channel(services.topo.router_address))

    @FUZZ
    @given(messages(router_pb2.RouteRequest.DESCRIPTOR),
           messages(router_pb2.CompleteRequest.DESCRIPTOR))
    def fuzz(route: router_pb2.RouteRequest, complete: router_pb2.CompleteRequest) -> None:
        if _call(lambda: stub.Route(route, timeout=CALL_TIMEOUT_S)) == grpc.StatusCode.OK:
            # Whatever Route counted comes back, as the frontend would report it.
            done = router_pb2.Completion(request_id=route.request_id,
                                         outcome=router_pb2.OUTCOME_OK)
            stub.Complete(router_pb2.CompleteRequest(completions=[done]), timeout=CALL_TIMEOUT_S)
        _call(lambda: stub.Complete(complete, timeout=CALL_TIMEOUT_S))

    fuzz()
    _all_serving(services)


def test_decode_and_worker_services(services: Services) -> None:
    channel = services.channel(services.topo.decode_addresses[0])
    decode = decode_pb2_grpc.DecodeStub(channel)
    worker = worker_pb2_grpc.WorkerStub(channel)
    events = kv_events_pb2_grpc.KvEventsStub(channel)

    @FUZZ
    @given(messages(decode_pb2.GenerateRequest.DESCRIPTOR),
           messages(worker_pb2.StatsRequest.DESCRIPTOR),
           messages(kv_events_pb2.SubscribeRequest.DESCRIPTOR))
    def fuzz(generate: decode_pb2.GenerateRequest, stats_request: worker_pb2.StatsRequest,
             subscribe: kv_events_pb2.SubscribeRequest) -> None:
        _call(lambda: decode.Generate(generate, timeout=CALL_TIMEOUT_S))
        _call(lambda: worker.Stats(stats_request, timeout=CALL_TIMEOUT_S))
        stream = events.Subscribe(subscribe, timeout=CALL_TIMEOUT_S)
        _call(lambda: next(stream))  # a subscription never ends by itself: read one message
        stream.cancel()

    fuzz()
    _no_leak(services)


def test_prefill_service(services: Services) -> None:
    stub = prefill_pb2_grpc.PrefillStub(services.channel(services.topo.prefill_addresses[0]))
    leased: list[str] = []

    @FUZZ
    @given(messages(prefill_pb2.PrefillRequest.DESCRIPTOR),
           messages(prefill_pb2.ReleaseRequest.DESCRIPTOR))
    def fuzz(prefill: prefill_pb2.PrefillRequest, release: prefill_pb2.ReleaseRequest) -> None:
        reply: list[prefill_pb2.PrefillResponse] = []
        code = _call(lambda: reply.append(stub.Prefill(prefill, timeout=CALL_TIMEOUT_S)))
        if code == grpc.StatusCode.OK and reply[0].HasField("kv_handle"):
            leased.append(prefill.request_id)
        _call(lambda: stub.Release(release, timeout=CALL_TIMEOUT_S))

    fuzz()
    for request_id in leased:  # a lease is the contract's, not a leak: give it back
        stub.Release(prefill_pb2.ReleaseRequest(request_id=request_id), timeout=CALL_TIMEOUT_S)
    _no_leak(services)
