"""Video requests at the router: only video pools serve them, least loaded first (its reported
queue plus what was handed out since), and text requests never land on a video worker."""
from __future__ import annotations

import pytest

from tandem.errors import InvalidRequest, Unavailable
from tandem.routing.config import PoolConfig
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.workers import LoadReport, SlaHints

TEXT = ["127.0.0.1:9200"]
VIDEO = ["127.0.0.1:9400", "127.0.0.1:9401"]


def _router() -> Router:
    return Router([PoolConfig("decode", "decode", list(TEXT)),
                   PoolConfig("video", "video", list(VIDEO), policy="least_loaded")],
                  None, 4, 1024)


def _video(rid: str, exclude: tuple[str, ...] = ()) -> RouteRequestInfo:
    return RouteRequestInfo(rid, (), (), 0, 0, SlaHints(), exclude, video=True)


def test_video_requests_go_to_the_least_loaded_video_worker() -> None:
    router = _router()
    busy = router.pools[1].workers[VIDEO[0]]
    busy.take_report(LoadReport(num_running=1, num_waiting=2), now=0.0)
    first = router.route(_video("v1"))
    assert first.decode_workers == () and first.video_workers[0].address == VIDEO[1]
    assert [w.address for w in first.video_workers] == [VIDEO[1], VIDEO[0]]
    assert router.in_flight(VIDEO[1]) == 1
    router.complete("v1")
    assert router.in_flight(VIDEO[1]) == 0


def test_text_requests_never_get_a_video_worker() -> None:
    router = _router()
    decision = router.route(RouteRequestInfo("t1", [1, 2, 3], (), 3, 8, SlaHints()))
    assert [w.address for w in decision.decode_workers] == TEXT
    assert decision.video_workers == ()


def test_no_video_worker_left_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="video"):
        _router().route(_video("v1", exclude=tuple(VIDEO)))


def test_a_video_pool_cannot_use_the_kv_policy() -> None:
    with pytest.raises(InvalidRequest) as info:
        Router([PoolConfig("video", "video", list(VIDEO), policy="kv")], None, 4, 1024)
    assert info.value.param == "pools[0].policy"
