"""The first delta of an answer, which every API's routes handle alike: with it the request
leaves the admission queue (RequestTracker.first_token), and a streamed answer waits for it
before its 200, so that routing and admission errors still reach the client as an HTTP status."""
from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from services.frontend.error_response import ErrorShape, error_response
from tandem.frontend.errors import http_error
from tandem.frontend.metrics import RequestTracker
from tandem.frontend.pipeline import Delta


async def first_delta(deltas: AsyncIterator[Delta], tracker: RequestTracker,
                      shape: ErrorShape = http_error) -> Delta | web.Response:
    """The first delta, or the error response (in `shape`, counted by `tracker`) to what
    generating it raised; nothing has been sent to the client either way."""
    try:
        first = await anext(deltas)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the API's error
        return error_response(exc, tracker, shape)
    tracker.first_token()
    return first


async def marking_first(deltas: AsyncIterator[Delta], tracker: RequestTracker,
                        kept: list[Delta] | None = None) -> AsyncIterator[Delta]:
    """`deltas` passed on as they come, for an answer collected whole: the first marks the
    request's answer started and goes into `kept`, when given."""
    seen = False
    async for delta in deltas:
        if not seen:
            seen = True
            tracker.first_token()
            if kept is not None:
                kept.append(delta)
        yield delta
