from __future__ import annotations

import pytest

from tandem.errors import Unavailable
from tandem.routing.round_robin import RoundRobinRouter
from tandem.routing.workers import WorkerRef

WORKERS = [WorkerRef(f"w{i}", f"127.0.0.1:{9200 + i}", "decode") for i in range(3)]


def test_rotates_and_orders_fallbacks() -> None:
    router = RoundRobinRouter(WORKERS)
    picks = [router.route(f"r{i}").decode_workers for i in range(4)]
    assert [p[0].worker_id for p in picks] == ["w0", "w1", "w2", "w0"]
    assert [w.worker_id for w in picks[1]] == ["w1", "w2", "w0"]


def test_in_flight_counts_from_hand_out_until_complete() -> None:
    router = RoundRobinRouter(WORKERS)
    for i in range(6):
        router.route(f"r{i}")
    assert [router.in_flight.count(w.worker_id) for w in WORKERS] == [2, 2, 2]
    assert router.complete("r0") and not router.complete("r0")  # idempotent
    assert router.in_flight.count("w0") == 1
    assert not router.complete("never-routed")


def test_exclusions_and_no_worker() -> None:
    router = RoundRobinRouter(WORKERS)
    assert router.route("a", exclude_ids=("w0", "w1")).decode_workers[0].worker_id == "w2"
    with pytest.raises(Unavailable, match="excluded"):
        router.route("b", exclude_ids=("w0", "w1", "w2"))
    assert router.in_flight.count("w2") == 1


def test_re_routing_the_same_request_does_not_double_count() -> None:
    router = RoundRobinRouter(WORKERS)
    router.route("same")
    router.route("same")
    assert sum(router.in_flight.count(w.worker_id) for w in WORKERS) == 1
