"""Stored responses (`store: true`, the default) for GET / DELETE /v1/responses/{id} and
`previous_response_id`: a bounded LRU in this process's memory.

What is kept is lost when the process restarts. A frontend whose port is shared with other
processes (--processes N, --reuse-port) keeps nothing: the kernel spreads connections among the
processes, so a response stored by one would be found by a later request only by chance; such a
store refuses previous_response_id and GET with a message saying so, rather than fail at random.
Access is from the event loop only (no locking)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidRequest, NotFound

JsonDict = dict[str, Any]


class ResponseNotFound(NotFound):
    """No stored response has that id (never stored, evicted, deleted, or another process's)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    #: The response object, as GET returns it.
    response: JsonDict
    #: The conversation before the response's output: the items it continued from
    #: (previous_response_id) and its own input items; instructions are not included.
    input_items: list[JsonDict]

    def conversation(self) -> list[JsonDict]:
        """What a request naming this response as previous_response_id continues from."""
        return [*self.input_items, *self.response["output"]]


class ResponseStore:
    """At most `capacity` responses, least recently used evicted first; 0 stores nothing.
    `shared`: this process shares its port with others (then nothing is stored either)."""

    def __init__(self, capacity: int, shared: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"responses store capacity must be >= 0, got {capacity}")
        self.capacity = 0 if shared else capacity
        self._shared = shared
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def is_enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        """Keeps `stored`, evicting the least recently used past capacity (no-op when off)."""
        if not self.is_enabled:
            return
        response_id = stored.response["id"]
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response, now the most recently used.

        Raises:
            ResponseNotFound: unknown id (the message says why when nothing is stored).
        """
        stored = self._items.get(response_id)
        if stored is None:
            raise ResponseNotFound(f"response with id '{response_id}' not found{self._why()}")
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        """Raises ResponseNotFound for an unknown id."""
        if self._items.pop(response_id, None) is None:
            raise ResponseNotFound(f"response with id '{response_id}' not found{self._why()}")

    def history(self, response_id: str) -> list[JsonDict]:
        """The conversation a previous_response_id continues from.

        Raises:
            InvalidRequest: unknown id (param "previous_response_id"), as OpenAI answers 400.
        """
        try:
            return self.get(response_id).conversation()
        except ResponseNotFound as exc:
            raise InvalidRequest(f"previous {exc.message}",
                                 param="previous_response_id") from None

    def _why(self) -> str:
        if self._shared:
            return (" (this frontend shares its port with other processes, so responses are "
                    "not stored: a later request could reach another process)")
        if not self.is_enabled:
            return " (this frontend stores no responses: --responses-store-size 0)"
        return ""
