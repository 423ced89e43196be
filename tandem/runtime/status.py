"""The one table from typed errors to gRPC status codes, and back for clients."""
from __future__ import annotations

import grpc

from tandem import errors

GRPC_CODES: dict[type[errors.TandemError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelNotFound: grpc.StatusCode.NOT_FOUND,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    errors.UpstreamError: grpc.StatusCode.INTERNAL,
}

_ERRORS_BY_CODE = {code: cls for cls, code in GRPC_CODES.items()}


def code_for(exc: errors.TandemError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in GRPC_CODES:
            return GRPC_CODES[cls]
    return grpc.StatusCode.INTERNAL


def details_for(exc: errors.TandemError) -> str:
    """The status message: the error's, led by the request field at fault (what OpenAI's error
    JSON calls `param`) where the error names one, so that gRPC callers learn it too."""
    param = exc.param
    return f"{param}: {exc.message}" if param and param not in exc.message else exc.message


_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def from_rpc_error(exc: grpc.aio.AioRpcError, peer: str) -> errors.TandemError:
    """A typed error for a failed call to `peer`, keeping the peer's message."""
    return error_for(exc.code(), exc.details() or "", peer)


def error_for(code: grpc.StatusCode | int, details: str, peer: str) -> errors.TandemError:
    """A typed error for a status `code` (or its number) and message returned by `peer`."""
    if isinstance(code, int):
        code = _CODES_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    cls = _ERRORS_BY_CODE.get(code, errors.UpstreamError)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        # A peer that cancels our call (e.g. its drain grace ran out) is unavailable to a client
        # that is still here: retryable, never the client's own "cancelled".
        return errors.Unavailable(f"{peer} unavailable: {details}")
    if cls is errors.UpstreamError:
        return errors.UpstreamError(f"{peer} failed ({code.name}): {details}")
    return cls(details or f"{peer}: {code.name}")
