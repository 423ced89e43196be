"""Video and embedding requests at the router: only pools of their kind serve them, least
loaded first (its reported queue plus what was handed out since), and text requests never land
on a video or embedding worker."""
from __future__ import annotations

import pytest

from tandem.errors import InvalidRequest, Unavailable
from tandem.routing.config import PoolConfig
from tandem.routing.router import Router, RouteRequestInfo
from tandem.routing.workers import LoadReport, RouteDecision, SlaHints

TEXT = ["127.0.0.1:9200"]
WHOLE = ["127.0.0.1:9400", "127.0.0.1:9401"]
KINDS = ["video", "embedding"]


def _router(kind: str) -> Router:
    return Router([PoolConfig("decode", "decode", list(TEXT)),
                   PoolConfig(kind, kind, list(WHOLE), policy="least_loaded")],
                  None, 4, 1024)


def _request(kind: str, rid: str, exclude: tuple[str, ...] = ()) -> RouteRequestInfo:
    return RouteRequestInfo(rid, (), (), 0, 0, SlaHints(), exclude, video=kind == "video",
                            embedding=kind == "embedding")


def _picks(kind: str, decision: RouteDecision) -> list[str]:
    workers = decision.video_workers if kind == "video" else decision.embedding_workers
    return [w.address for w in workers]


@pytest.mark.parametrize("kind", KINDS)
def test_requests_go_to_the_least_loaded_worker_of_their_kind(kind: str) -> None:
    router = _router(kind)
    busy = router.pools[1].workers[WHOLE[0]]
    busy.take_report(LoadReport(num_running=1, num_waiting=2), now=0.0)
    first = router.route(_request(kind, "v1"))
    assert first.decode_workers == () and _picks(kind, first) == [WHOLE[1], WHOLE[0]]
    assert first.pick.address == WHOLE[1]
    assert router.in_flight(WHOLE[1]) == 1
    router.complete("v1")
    assert router.in_flight(WHOLE[1]) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_text_requests_never_get_a_video_or_embedding_worker(kind: str) -> None:
    decision = _router(kind).route(RouteRequestInfo("t1", [1, 2, 3], (), 3, 8, SlaHints()))
    assert [w.address for w in decision.decode_workers] == TEXT
    assert decision.video_workers == () and decision.embedding_workers == ()


@pytest.mark.parametrize("kind", KINDS)
def test_no_worker_of_the_kind_left_is_unavailable(kind: str) -> None:
    with pytest.raises(Unavailable, match=kind):
        _router(kind).route(_request(kind, "v1", exclude=tuple(WHOLE)))


@pytest.mark.parametrize("kind", KINDS)
def test_such_a_pool_cannot_use_the_kv_policy(kind: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        Router([PoolConfig(kind, kind, list(WHOLE), policy="kv")], None, 4, 1024)
    assert info.value.param == "pools[0].policy"
