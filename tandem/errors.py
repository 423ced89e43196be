"""Typed errors raised by the library. Each boundary maps them to its own status from one table
(gRPC codes in tandem.runtime.status, HTTP statuses in tandem.frontend.errors)."""
from __future__ import annotations


class TandemError(Exception):
    """Base of every error that should reach a client with its message intact."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: The request field at fault, when there is one (OpenAI's error.param).
        self.param = param


class InvalidRequest(TandemError):
    """The request is malformed or its values are out of range."""


class ModelNotFound(TandemError):
    """The request names a model this deployment does not serve."""


class NotFound(TandemError):
    """A resource the request names by id (a stored response) does not exist."""


class Unauthenticated(TandemError):
    """The request carries no valid API key."""


class Overloaded(TandemError):
    """A bounded queue is full; the client should retry later."""


class Unavailable(TandemError):
    """The service is draining or no worker can take the request."""


class DeadlineExceeded(TandemError):
    """The request's deadline passed before it completed."""


class Cancelled(TandemError):
    """The request was cancelled by its client."""


class FailedPrecondition(TandemError):
    """The request cannot run in this worker's state (e.g. a KV layout mismatch)."""


class Unimplemented(TandemError):
    """The capability exists in the contract but not yet in this build; the message says which."""


class UpstreamError(TandemError):
    """A downstream service failed; the message says which and why."""
