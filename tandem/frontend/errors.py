"""The one table from typed errors to HTTP statuses and OpenAI error bodies.

Clients see the message of a `TandemError` listed in `HTTP_ERRORS` (or of a subclass, matched
through its MRO). Anything else, including an unlisted TandemError, becomes 500 "internal_error"
with a generic message: the caller logs the detail, the client never sees it.
"""
from __future__ import annotations

from typing import Any

from tandem import errors

#: error class -> (HTTP status, OpenAI error type, OpenAI error code or None).
HTTP_ERRORS: dict[type[errors.TandemError], tuple[int, str, str | None]] = {
    errors.InvalidRequest: (400, "invalid_request_error", None),
    errors.ModelNotFound: (404, "not_found_error", "model_not_found"),
    errors.NotFound: (404, "invalid_request_error", "not_found"),
    errors.Unauthenticated: (401, "authentication_error", "invalid_api_key"),
    errors.Overloaded: (429, "rate_limit_error", None),
    errors.Unavailable: (503, "service_unavailable", None),
    errors.DeadlineExceeded: (504, "timeout", None),
    # 499: nginx's "client closed request"; rarely seen, the client has usually gone.
    errors.Cancelled: (499, "cancelled", None),
    errors.FailedPrecondition: (400, "invalid_request_error", "failed_precondition"),
    errors.Unimplemented: (501, "not_implemented", None),
    errors.UpstreamError: (502, "upstream_error", None),
}
INTERNAL_STATUS = 500
INTERNAL_TYPE = "internal_error"
INTERNAL_MESSAGE = "The server had an internal error while processing the request."


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def http_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for `exc`; never leaks an unexpected error's detail."""
    if isinstance(exc, errors.TandemError):
        for cls in type(exc).__mro__:
            row = HTTP_ERRORS.get(cls)
            if row is not None:
                status, kind, code = row
                return status, error_body(exc.message, kind, exc.param, code)
    return INTERNAL_STATUS, error_body(INTERNAL_MESSAGE, INTERNAL_TYPE)
