"""The one table from typed errors to gRPC status codes, and back for clients."""
from __future__ import annotations

import grpc

from tandem import errors

GRPC_CODES: dict[type[errors.TandemError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelNotFound: grpc.StatusCode.NOT_FOUND,
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


def from_rpc_error(exc: grpc.aio.AioRpcError, peer: str) -> errors.TandemError:
    """A typed error for a failed call to `peer`, keeping the peer's message."""
    cls = _ERRORS_BY_CODE.get(exc.code(), errors.UpstreamError)
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        # A peer that cancels our call (e.g. its drain grace ran out) is unavailable to a client
        # that is still here: retryable, never the client's own "cancelled".
        return errors.Unavailable(f"{peer} unavailable: {exc.details()}")
    if cls is errors.UpstreamError:
        return errors.UpstreamError(f"{peer} failed ({exc.code().name}): {exc.details()}")
    return cls(exc.details() or f"{peer}: {exc.code().name}")
