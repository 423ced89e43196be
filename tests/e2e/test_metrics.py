"""Prometheus metrics of every service, scraped over HTTP after a known set of requests through a
disaggregated topology (mock engine): requests by status and endpoint, token histograms, TTFT,
cached tokens, router decisions per pool, KV transfer bytes and latency, build info."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.disagg_probe import wait_idle
from tests.e2e.topology import Topology, free_ports, start_topology

#: The demo model's mock KV block: 2 layers x K,V x 32 tokens x 2 heads x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * 32 * 2 * 16 * 4
BLOCK_TOKENS = 32


@dataclass
class Scrapes:
    topo: Topology
    frontend: str
    router: str
    decode: str
    prefill: str
    #: The frontend's own metrics port (--metrics-port): the same registry as its OpenAI port.
    frontend_port: str

    def read(self, url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample at `url`: (name, labels) -> value."""
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    return sum(value for (n, got), value in samples.items()
               if n == name and set(labels.items()) <= got)


@pytest.fixture(scope="module")
def scrapes() -> Iterator[Scrapes]:
    frontend, router, decode, prefill = free_ports(4)
    # The router decides every request (no local routing): its decision metrics are checked.
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", "--no-local-routing",
                          "--router-metrics-port",
                          str(router), "--worker-metrics-ports", str(decode), str(prefill),
                          "--frontend-metrics-port", str(frontend), num_prefill=1)
    url = "http://127.0.0.1:{}/metrics".format
    yield Scrapes(topo, topo.http_url + "/metrics", url(router), url(decode), url(prefill),
                  url(frontend))
    assert topo.stop() == 0


def post(topo: Topology, path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(topo.http_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def streamed_usage(raw: bytes) -> dict:
    events = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n\n")
              if line.startswith(b"data: {")]
    return events[-1]["usage"]


def test_counts_after_a_known_set_of_requests(scrapes: Scrapes) -> None:
    topo = scrapes.topo
    prompt = [(i * 7) % 3000 + 10 for i in range(100)]  # 3 full blocks + 4 tokens
    usages = []
    # 3 streaming completions; the second and third reuse the first's prompt (prefix cache).
    for max_tokens in (5, 7, 9):
        status, raw = post(topo, "/v1/completions", {
            "model": topo.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200
        usages.append(streamed_usage(raw))
    # 2 non-streaming chat completions.
    for max_tokens in (3, 4):
        status, raw = post(topo, "/v1/chat/completions", {
            "model": topo.model, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Count to {max_tokens}, please."}]})
        assert status == 200
        usages.append(json.loads(raw)["usage"])
    # 1 through the public gRPC API.
    with grpc.insecure_channel(topo.grpc_address) as channel:
        chunks = list(inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.InferenceRequest(
                model=topo.model, tokens=inference_pb2.TokenInput(token_ids=prompt[:50]),
                sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True)), timeout=60))
    grpc_usage = chunks[-1].usage
    # 1 bad request (n beyond its limit) and 1 for an unknown model.
    assert post(topo, "/v1/completions", {"model": topo.model, "prompt": "x", "n": 17})[0] == 400
    assert post(topo, "/v1/completions", {"model": "nope", "prompt": "x"})[0] == 404

    assert [u["completion_tokens"] for u in usages] == [5, 7, 9, 3, 4]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached == 2 * 3 * BLOCK_TOKENS  # the 2nd and 3rd prompts hit 3 cached blocks
    prompt_tokens = sum(u["prompt_tokens"] for u in usages) + grpc_usage.prompt_tokens

    f = scrapes.read(scrapes.frontend)
    assert scrapes.read(scrapes.frontend_port) == f
    assert total(f, "tandem_frontend_requests_total", endpoint="completions", status="200") == 3
    assert total(f, "tandem_frontend_requests_total", endpoint="chat_completions",
                 status="200") == 2
    assert total(f, "tandem_frontend_requests_total", endpoint="grpc_generate",
                 status="200") == 1
    assert total(f, "tandem_frontend_requests_total", status="400") == 1
    assert total(f, "tandem_frontend_requests_total", status="404") == 1
    assert total(f, "tandem_frontend_output_sequence_tokens_count") == 6
    assert total(f, "tandem_frontend_output_sequence_tokens_sum") == 5 + 7 + 9 + 3 + 4 + 6
    assert total(f, "tandem_frontend_output_tokens_total") == 5 + 7 + 9 + 3 + 4 + 6
    assert total(f, "tandem_frontend_input_sequence_tokens_sum") == prompt_tokens
    assert total(f, "tandem_frontend_time_to_first_token_seconds_count") == 6
    assert total(f, "tandem_frontend_cached_tokens_total") == cached + grpc_usage.cached_tokens
    assert total(f, "tandem_frontend_request_duration_seconds_count") == 8
    assert total(f, "tandem_frontend_inflight_requests") == 0
    assert total(f, "tandem_frontend_queued_requests") == 0
    # Counted as they arrived too (the planner's rate and ISL), none still waiting.
    assert total(f, "tandem_frontend_arrivals_total") == 6
    assert total(f, "tandem_frontend_arrival_prompt_tokens_total") == prompt_tokens
    assert total(f, "tandem_frontend_queued_prompt_tokens") == 0
    assert total(f, "tandem_frontend_queued_generations") == 0
    assert total(f, "tandem_build_info", service="frontend") == 1
    # Per-hop latency of streamed tokens: every decode batch gives the worker's two hops; each
    # streamed HTTP request wrote at least one measured chunk. Loopback hops take far below 1 s.
    hop = "tandem_frontend_token_hop_seconds"
    for name, least in (("engine_to_send", 6), ("send_to_receive", 6), ("receive_to_sse", 3)):
        count = total(f, f"{hop}_count", hop=name)
        assert count >= least, name
        assert 0 < total(f, f"{hop}_sum", hop=name) < count, name

    r = scrapes.read(scrapes.router)
    # Every successful request was disaggregated: one decode and one prefill pick each.
    assert total(r, "tandem_router_decisions_total", pool="decode") == 6
    assert total(r, "tandem_router_decisions_total", pool="prefill") == 6
    assert total(r, "tandem_router_decision_seconds_count") == 6
    assert total(r, "tandem_router_overlap_blocks_count", pool="prefill") == 6
    assert total(r, "tandem_build_info", service="router") == 1

    d = scrapes.read(scrapes.decode)
    assert total(d, "tandem_kv_transfers_total") == 6
    # Every block of every prompt, the last partial one included.
    blocks = sum(-(-u["prompt_tokens"] // BLOCK_TOKENS) for u in usages)
    blocks += -(-grpc_usage.prompt_tokens // BLOCK_TOKENS)
    assert total(d, "tandem_kv_transfer_bytes_total") == blocks * BLOCK_BYTES
    assert total(d, "tandem_kv_transfer_seconds_count") == 6
    assert total(d, "tandem_kv_transfer_failures_total") == 0
    assert total(d, "tandem_worker_kv_blocks_total") > 0
    assert total(d, "tandem_build_info", service="decode") == 1

    # The decode worker releases each lease once its read is over, in the background.
    wait_idle(*topo.prefill_addresses)
    p = scrapes.read(scrapes.prefill)
    assert total(p, "tandem_worker_prefix_cache_hit_rate") > 0
    assert total(p, "tandem_kv_lease_expiries_total") == 0
    # What the prefill worker served: a handle per disaggregated request, the very KV the
    # decode worker read, every lease released by the decode worker and held meanwhile.
    assert total(p, "tandem_worker_prefills_total", outcome="leased") == 6
    assert total(p, "tandem_worker_prefills_total", outcome="finished") == 0
    assert total(p, "tandem_worker_prefills_total", outcome="failed") == 0
    assert total(p, "tandem_worker_kv_bytes_leased_total") == blocks * BLOCK_BYTES
    assert total(p, "tandem_worker_kv_blocks_leased_total") == blocks
    assert total(p, "tandem_worker_kv_leases_released_total") == 6
    hold = "tandem_worker_kv_lease_hold_seconds"
    assert total(p, f"{hold}_count", ended="released") == 6
    assert total(p, f"{hold}_count", ended="expired") == 0
    assert 0 < total(p, f"{hold}_sum", ended="released") < 6 * 30
    assert total(p, "tandem_build_info", service="prefill") == 1
