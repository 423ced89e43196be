"""The responses store: bounded LRU, delete, disabled (size 0 or a shared port) with errors that
say why, and previous_response_id lookups as 400s naming the field."""
from __future__ import annotations

import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.responses_store import ResponseNotFound, ResponseStore, StoredResponse


def stored(response_id: str) -> StoredResponse:
    output = [{"type": "message", "id": f"msg_{response_id}"}]
    return StoredResponse({"id": response_id, "output": output},
                          [{"type": "message", "role": "user", "content": response_id}])


def test_keeps_at_most_capacity_evicting_least_recently_used() -> None:
    store = ResponseStore(2)
    store.put(stored("a"))
    store.put(stored("b"))
    store.get("a")  # now b is the least recently used
    store.put(stored("c"))
    assert len(store) == 2
    assert store.get("a").response["id"] == "a" and store.get("c").response["id"] == "c"
    with pytest.raises(ResponseNotFound):
        store.get("b")


def test_delete_removes_once() -> None:
    store = ResponseStore(4)
    store.put(stored("a"))
    store.delete("a")
    with pytest.raises(ResponseNotFound):
        store.get("a")
    with pytest.raises(ResponseNotFound):
        store.delete("a")


def test_history_is_input_then_output_and_unknown_is_a_400() -> None:
    store = ResponseStore(4)
    store.put(stored("a"))
    assert store.history("a") == [{"type": "message", "role": "user", "content": "a"},
                                  {"type": "message", "id": "msg_a"}]
    with pytest.raises(InvalidRequest) as info:
        store.history("zz")
    assert info.value.param == "previous_response_id" and "'zz'" in info.value.message


@pytest.mark.parametrize(("store", "why"), [
    (ResponseStore(0), "--responses-store-size 0"),
    (ResponseStore(10, shared=True), "shares its port"),
])
def test_disabled_store_keeps_nothing_and_says_why(store: ResponseStore, why: str) -> None:
    store.put(stored("a"))
    assert not store.is_enabled and len(store) == 0
    with pytest.raises(ResponseNotFound) as info:
        store.get("a")
    assert why in info.value.message


def test_negative_capacity_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        ResponseStore(-1)
