"""The router's decision: pools, grid, policies, fallbacks, load from hand-out to Complete."""
from __future__ import annotations

import pytest

from tandem.engines.types import BlockStored
from tandem.errors import InvalidRequest, Unavailable
from tandem.kv.hashing import block_hashes
from tandem.routing.config import PoolConfig
from tandem.routing.grid_config import load_grid_config
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.workers import SlaHints

ADDRS = [f"127.0.0.1:{9200 + i}" for i in range(3)]


def info(rid: str, tokens: list[int] | None = None, sla: SlaHints | None = None,
         exclude: tuple[str, ...] = ()) -> RouteRequestInfo:
    tokens = tokens or [1, 2, 3]
    return RouteRequestInfo(rid, tokens, (), len(tokens), 16, sla or SlaHints(), exclude)


def one_pool(policy: str = "round_robin") -> Router:
    return Router([PoolConfig("decode", "decode", list(ADDRS), policy=policy)], None, 4, 1024)


def test_round_robin_rotates_and_orders_fallbacks() -> None:
    router = one_pool()
    picks = [router.route(info(f"r{i}")).decode_workers for i in range(4)]
    firsts = [p[0].worker_id for p in picks]
    assert firsts[:3] == sorted(firsts[:3]) or len(set(firsts[:3])) == 3
    assert len(set(firsts[:3])) == 3 and firsts[3] == firsts[0]
    assert all(len(p) == 3 for p in picks)  # the rest are fallbacks


def test_in_flight_counts_from_hand_out_until_complete() -> None:
    router = one_pool()
    for i in range(6):
        router.route(info(f"r{i}"))
    assert sorted(router.in_flight(a) for a in ADDRS) == [2, 2, 2]
    assert router.complete("r0") and not router.complete("r0")  # idempotent
    assert not router.complete("never-routed")
    assert sum(router.in_flight(a) for a in ADDRS) == 5


def test_exclusions_unhealthy_workers_and_no_worker() -> None:
    router = one_pool()
    router.pools[0].workers[ADDRS[2]].healthy = False
    assert router.route(info("a", exclude=(ADDRS[0],))).decode_workers[0].worker_id == ADDRS[1]
    with pytest.raises(Unavailable, match="excluded"):
        router.route(info("b", exclude=(ADDRS[0], ADDRS[1])))


AGG_GRID = {
    "mode": "agg",
    "num_agg_pools": 2,
    "agg_pool_selection_strategy": {
        "ttft_min_ms": 0, "ttft_max_ms": 1000, "ttft_resolution": 2,
        "itl_min_ms": 0, "itl_max_ms": 100, "itl_resolution": 1,
        # tight TTFT -> pool 0 (fast), relaxed -> pool 1
        "agg_pool_mapping": [[0], [1]],
    },
    "enable_priority_retry": True,
}


def two_agg_pools() -> Router:
    pools = [PoolConfig("fast", "agg", [ADDRS[0]]), PoolConfig("slow", "agg", [ADDRS[1]])]
    return Router(pools, load_grid_config(AGG_GRID), 4, 1024)


def test_grid_picks_the_pool_and_retries_on_faster_pools() -> None:
    router = two_agg_pools()
    tight = router.route(info("t", sla=SlaHints(ttft_ms=100))).decode_workers
    assert [w.pool for w in tight] == ["fast"]  # nothing faster to retry on
    relaxed = router.route(info("r", sla=SlaHints(ttft_ms=900))).decode_workers
    assert [w.pool for w in relaxed] == ["slow", "fast"]  # retry on the faster pool
    router.pools[1].workers[ADDRS[1]].healthy = False
    assert router.route(info("x", sla=SlaHints(ttft_ms=900))).decode_workers[0].pool == "fast"


def test_grid_pool_count_must_match_the_router_pools() -> None:
    with pytest.raises(InvalidRequest, match="2 agg pools"):
        Router([PoolConfig("only", "agg", [ADDRS[0]])], load_grid_config(AGG_GRID), 4, 1024)


def test_kv_policy_prefers_the_worker_holding_the_prefix() -> None:
    router = one_pool("kv")
    tokens = list(range(100, 140))  # 10 blocks of 4
    hashes = block_hashes(tokens, 4)
    holder = ADDRS[1]
    router.index.apply(holder, [BlockStored(tuple(hashes[:8]), None, tuple(tokens[:32]), 4)])
    decision = router.route(info("kv", tokens))
    assert decision.decode_workers[0].worker_id == holder
    assert decision.overlap_blocks == 8
    # The hand-out counts at once: the holder now carries the new request's load.
    assert router.pools[0].workers[holder].pending_requests == 1


def test_complete_takes_back_a_hand_out_no_report_covered() -> None:
    router = one_pool("least_loaded")
    decision = router.route(info("short"))
    worker = router.pools[0].workers[decision.decode_workers[0].worker_id]
    assert worker.active_requests == 1
    router.complete("short")  # finished before any load report: the estimate drops at once
    assert worker.active_requests == 0 and worker.active_decode_blocks == 0
    router.route(info("long"))
    worker2 = [w for w in router.pools[0].workers.values() if w.pending_requests][0]
    worker2.report(0, 1, 1)  # the worker reported it (1 block): the report carries its load
    router.complete("long")
    assert worker2.active_requests == 0  # taken out of the report until the next one
    assert worker2.active_decode_blocks == 0


def test_grid_pool_names_must_match_the_router_order() -> None:
    named = {**AGG_GRID, "agg_pool_dynamo_namespaces": ["slow", "fast"]}
    pools = [PoolConfig("fast", "agg", [ADDRS[0]]), PoolConfig("slow", "agg", [ADDRS[1]])]
    with pytest.raises(InvalidRequest, match="same names, same order"):
        Router(pools, load_grid_config(named), 4, 1024)
    ok = {**AGG_GRID, "agg_pool_dynamo_namespaces": ["fast", "slow"]}
    assert [p.name for p in Router(pools, load_grid_config(ok), 4, 1024).pools] == ["fast", "slow"]


def test_encode_pool_is_picked_only_for_images_and_counted_until_complete() -> None:
    encoders = ["127.0.0.1:9400", "127.0.0.1:9401"]
    router = Router([PoolConfig("decode", "decode", ADDRS[:1]),
                     PoolConfig("encode", "encode", encoders, policy="least_loaded")],
                    None, 4, 1024)
    text = router.route(info("text"))
    assert text.encode_workers == () and text.decode_workers[0].pool == "decode"
    with_images = [router.route(RouteRequestInfo(f"img{i}", [1, 2, 3], (), 3, 16, SlaHints(),
                                                 has_images=True)) for i in range(2)]
    # Least loaded: the second request goes to the encoder the first one did not take.
    assert [d.encode_workers[0].worker_id for d in with_images] in (encoders, encoders[::-1])
    assert all(len(d.encode_workers) == 2 for d in with_images)  # the other is the fallback
    assert [router.in_flight(a) for a in encoders] == [1, 1]
    assert router.in_flight(ADDRS[0]) == 3  # the decode worker serves all three
    assert router.complete("img0") and router.complete("img1")
    assert [router.in_flight(a) for a in encoders] == [0, 0]
    for worker in router.pools[1].workers.values():
        worker.healthy = False
    # No healthy encoder: the request still routes; the decode worker encodes itself.
    alone = router.route(RouteRequestInfo("img2", [1, 2, 3], (), 3, 16, SlaHints(),
                                          has_images=True))
    assert alone.encode_workers == () and alone.decode_workers[0].worker_id == ADDRS[0]
    with pytest.raises(InvalidRequest, match="encode pool"):
        Router([PoolConfig("encode", "encode", encoders, policy="kv")], None, 4, 1024)


def test_disaggregation_hands_out_both_workers_and_only_decode_workers_make_it_serve() -> None:
    router = Router([PoolConfig("decode", "decode", ["d:1"]),
                     PoolConfig("prefill", "prefill", ["p:1"])], None, 4, 1024)
    decision = router.route(RouteRequestInfo("r", list(range(40)), (), 40, 16, SlaHints()))
    assert decision.disaggregate and decision.prefill_workers[0].worker_id == "p:1"
    assert router.in_flight("p:1") == router.in_flight("d:1") == 1
    router.complete("r")
    assert router.in_flight("p:1") == router.in_flight("d:1") == 0
    # Short prompts stay on the decode worker (conditional disaggregation).
    short = router.route(RouteRequestInfo("s", [1, 2, 3], (), 3, 16, SlaHints(),
                                          max_local_prefill_length=8))
    assert not short.disaggregate and not short.prefill_workers
    workers = {w.worker_id: w for w in router.all_workers()}
    workers["d:1"].healthy = False
    assert not router.can_serve()  # a prefill worker alone serves nothing
    workers["d:1"].healthy = True
    assert router.can_serve()
