"""A failed request's HTTP answer, the same for every API's routes: the status and body from
the API's error table, a log line for unexpected server errors, the request counted under its
status, and Retry-After where retrying soon makes sense."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tandem.frontend.errors import http_error
from tandem.frontend.metrics import RequestTracker

log = logging.getLogger(__name__)
#: Overloaded (429) and draining/unavailable (503) are worth retrying shortly.
RETRYABLE = frozenset({429, 503})
RETRY_AFTER_S = "1"

ErrorShape = Callable[[BaseException], tuple[int, dict[str, Any]]]


def error_response(exc: BaseException, tracker: RequestTracker | None = None,
                   shape: ErrorShape = http_error) -> web.Response:
    """`exc` as JSON in `shape` (OpenAI's by default); `tracker`, when given, counts it."""
    status, body = shape(exc)
    if status >= 500 and status not in RETRYABLE:
        log.error("request failed", exc_info=exc)
    if tracker is not None:
        tracker.finish(str(status))
    headers = {"Retry-After": RETRY_AFTER_S} if status in RETRYABLE else None
    return web.json_response(body, status=status, headers=headers)
