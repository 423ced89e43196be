"""Errors of the Anthropic Messages API: {"type": "error", "error": {"type", "message"}}.

The HTTP status comes from the one table, tandem.frontend.errors; the Anthropic error type
follows from the status (as Anthropic documents them). Tandem's 503 (draining, no worker) keeps
its status and is typed "overloaded_error", which Anthropic's clients retry like its 529.
"""
from __future__ import annotations

from typing import Any

from tandem.frontend.errors import http_error

#: HTTP status -> Anthropic error type; any other status >= 500 is "api_error".
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error JSON; `param` (the request field at fault, Anthropic's name for it) is
    a Tandem addition that Anthropic's clients ignore."""
    error: dict[str, Any] = {"type": error_type(status), "message": message}
    if param is not None:
        error["param"] = param
    return {"type": "error", "error": error}


def anthropic_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, Anthropic error body) for `exc`; never leaks an unexpected error's
    detail (tandem.frontend.errors.http_error decides what a client may see)."""
    status, body = http_error(exc)
    error = body["error"]
    return status, error_body(status, error["message"], error.get("param"))
