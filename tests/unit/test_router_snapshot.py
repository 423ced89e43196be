"""The router's snapshot of its pools and workers (Router.ListWorkers, `tandem status`): who is a
candidate and why not, the load the router counts and the load each worker last reported; the
same snapshot back from protobuf; `tandem status` against an in-process router."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from services.router.servicer import RouterServicer
from tandem.launcher import status as status_cmd
from tandem.routing.config import PoolConfig
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.snapshot import all_candidates, not_candidates
from tandem.routing.workers import Health, LoadReport, SlaHints, WorkerState
from tandem.runtime.devices import Device
from tandem.runtime.router_status import pools_from_pb, pools_to_pb
from tandem.runtime.served import ServedStats
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.v1 import router_pb2_grpc

DECODE = ["d:0", "d:1", "d:2", "d:3"]
PREFILL = ["p:0"]


def router() -> Router:
    return Router([PoolConfig("fast", "decode", list(DECODE), policy="least_loaded"),
                   PoolConfig("pre", "prefill", list(PREFILL), policy="kv")], None, 4, 1024)


def workers(r: Router) -> dict[str, WorkerState]:
    return {w.worker_id: w for w in r.all_workers()}


def set_state(w: WorkerState, health: Health, events: bool, health_error: str = "",
              events_error: str = "") -> None:
    """What the watcher does when a stream reports or breaks."""
    w.health, w.events_connected = health, events
    w.health_error, w.events_error = health_error, events_error
    w.refresh_candidacy()


def info(rid: str, isl: int = 8) -> RouteRequestInfo:
    return RouteRequestInfo(rid, list(range(1, isl + 1)), (), isl, 16, SlaHints())


def test_candidates_and_the_reason_of_each_non_candidate() -> None:
    r = router()
    ws = workers(r)
    for w in ws.values():
        w.healthy = False  # as the router's membership starts them
    set_state(ws["d:0"], Health.SERVING, True)
    set_state(ws["d:1"], Health.NOT_SERVING, True)
    set_state(ws["d:2"], Health.UNREACHABLE, False, "UNAVAILABLE: connection refused",
              "UNAVAILABLE: connection refused")
    set_state(ws["d:3"], Health.UNKNOWN, False)
    set_state(ws["p:0"], Health.SERVING, False, events_error="UNAVAILABLE: stream reset")
    pools = r.snapshot(now=100.0)
    assert [(p.name, p.kind, p.policy) for p in pools] == [("fast", "decode", "least_loaded"),
                                                           ("pre", "prefill", "kv")]
    by_id = {w.worker_id: w for p in pools for w in p.workers}
    assert [w.worker_id for w in pools[0].workers] == DECODE  # config order
    assert by_id["d:0"].candidate and by_id["d:0"].reason == ""
    assert not by_id["d:1"].candidate and by_id["d:1"].reason == "health NOT_SERVING"
    # An unreachable worker's event stream broke for the same cause: said once.
    assert by_id["d:2"].reason == "unreachable (UNAVAILABLE: connection refused)"
    assert by_id["d:2"].health is Health.UNREACHABLE and not by_id["d:2"].events_connected
    assert by_id["d:3"].reason == "no health answer yet; event stream not connected yet"
    assert by_id["p:0"].reason == "event stream down (UNAVAILABLE: stream reset)"
    assert not all_candidates(pools)
    assert [w.worker_id for _, w in not_candidates(pools)] == ["d:1", "d:2", "d:3", "p:0"]
    # Once every stream is up, every worker is a candidate: what `tandem up` waits for.
    for w in ws.values():
        set_state(w, Health.SERVING, True)
    assert all_candidates(r.snapshot(now=100.0))


def test_a_worker_taken_out_by_hand_still_gets_a_reason() -> None:
    r = router()
    ws = workers(r)
    set_state(ws["d:0"], Health.SERVING, True)
    ws["d:0"].healthy = False
    assert r.snapshot(0.0)[0].workers[0].reason == "taken out of the candidate set"


def test_no_worker_is_not_ready() -> None:
    empty = Router([PoolConfig("dns", "decode", [])], None, 4, 1024)
    assert not all_candidates(empty.snapshot(0.0))


def test_load_counted_by_the_router_and_reported_by_the_worker() -> None:
    r = router()
    ws = workers(r)
    ws["p:0"].healthy = False  # aggregated: the decode pick prefills too
    assert r.snapshot(5.0)[0].workers[0].last_load is None
    assert r.snapshot(5.0)[0].workers[0].last_load_age_s is None
    report = LoadReport(num_running=2, num_waiting=1, kv_blocks_used=30, kv_blocks_total=120,
                        pending_prefill_tokens=9, active_decode_blocks=20,
                        prefix_cache_hit_rate=0.5, timestamp_unix_ms=1234)
    ws["d:0"].take_report(report, now=10.0)
    # least_loaded: the idle workers take requests until they carry more than the 3 d:0
    # reported; the 13th is d:0's.
    routed = []
    for i in range(16):
        decision = r.route(info(f"r{i}"))
        routed.append((f"r{i}", decision.decode_workers[0].worker_id))
    snap = {w.worker_id: w for w in r.snapshot(now=12.5)[0].workers}
    d0 = snap["d:0"]
    assert d0.last_load == report and d0.last_load_age_s == 2.5
    assert d0.in_flight_requests > 0
    for worker_id, w in snap.items():
        mine = [rid for rid, wid in routed if wid == worker_id]
        assert w.in_flight_requests == len(mine), worker_id
    # The router's count: the report's running + waiting (3) plus what it handed out since.
    assert d0.active_requests == 3 + d0.in_flight_requests
    assert d0.active_prefill_blocks == 3 + 2 * d0.in_flight_requests  # 9 tokens: 3 blocks
    assert d0.active_decode_blocks == 20 + 2 * d0.in_flight_requests
    for rid, _ in routed:
        assert r.complete(rid)
    assert all(w.in_flight_requests == 0 for w in r.snapshot(13.0)[0].workers)


def test_a_disaggregated_request_counts_once_on_each_of_its_workers() -> None:
    r = router()
    decision = r.route(info("r0", isl=64))
    assert decision.disaggregate
    snap = {w.worker_id: w for p in r.snapshot(0.0) for w in p.workers}
    assert snap["p:0"].in_flight_requests == 1
    assert snap[decision.decode_workers[0].worker_id].in_flight_requests == 1
    assert sum(w.in_flight_requests for w in snap.values()) == 2


def test_snapshot_survives_protobuf() -> None:
    r = router()
    ws = workers(r)
    set_state(ws["d:1"], Health.NOT_SERVING, False, events_error="CANCELLED: gone")
    ws["d:0"].take_report(LoadReport(1, 2, 3, 4, 5, 6, 0.25, 7), now=1.0)
    # What a worker served and its devices ride on its load report.
    ws["p:0"].take_report(LoadReport(0, 0, 1, 64, served=ServedStats(
        prefills_leased=3, prefills_finished=1, prefills_failed=2, kv_bytes_leased=4096,
        kv_blocks_leased=1, kv_leases_released=2, kv_leases_expired=1, kv_reads_ok=5,
        kv_reads_failed=6, kv_bytes_read=7, kv_read_seconds=0.5),
        devices=(Device("3", "NVIDIA H200"), Device("GPU-0a1b"))), now=1.0)
    r.route(info("r0"))
    pools = r.snapshot(now=2.75)
    assert pools_from_pb(pools_to_pb(pools)) == pools


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_tandem_status_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    r = router()
    ws = workers(r)
    set_state(ws["d:1"], Health.NOT_SERVING, True)
    ws["d:0"].take_report(LoadReport(num_running=1, kv_blocks_used=30, kv_blocks_total=120),
                          now=0.0)
    service = GrpcService(ServerOptions("127.0.0.1", 0, grace_s=1), ["tandem.v1.Router"])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(r, 1024), service.server)
    await service.start()
    try:
        # main() runs its own event loop: off this one, which serves the router.
        code = await asyncio.to_thread(status_cmd.main, ["--router-address", service.address,
                                                          "--api-key", "sk-x"])
        table = capsys.readouterr().out.splitlines()
        code_json = await asyncio.to_thread(status_cmd.main, ["--router-address",
                                                               service.address, "--json"])
        listed = json.loads(capsys.readouterr().out)
    finally:
        await service.shutdown()
    assert code == code_json == 0
    assert table[0] == f"router {service.address}: 2 pool(s), 5 worker(s), 4 candidate(s)"
    assert table[1].split()[:5] == ["POOL", "KIND", "WORKER", "ADDRESS", "CANDIDATE"]
    rows = {line.split()[2]: line for line in table[2:]}
    assert rows["d:0"].split()[:8] == ["fast", "decode", "d:0", "d:0", "yes", "0", "30/120",
                                       "(25%)"]
    assert rows["d:1"].split()[4] == "no" and rows["d:1"].endswith("health NOT_SERVING")
    assert rows["d:2"].split()[4:7] == ["yes", "0", "-"]  # no report yet
    workers_json = {w["worker_id"]: w for p in listed["pools"] for w in p["workers"]}
    assert listed["router"] == service.address
    assert workers_json["d:1"]["candidate"] is False
    assert workers_json["d:1"]["health"] == "not_serving"
    assert workers_json["d:0"]["last_load"]["kv_blocks_total"] == 120
    assert workers_json["d:2"]["last_load"] is None


def test_tandem_status_without_a_router_says_so_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{_free_port()}"
    assert status_cmd.main(["--router-address", address, "--timeout-s", "5"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith(
        f"tandem status: router {address} unavailable: ")
