"""The server interceptor every Tandem service installs.

It binds the request id (metadata `x-request-id`, else a fresh one) to the log context, runs the
steps of a request inside a server span (a child of the caller's W3C trace context, when tracing
is on) and maps typed errors to status codes from tandem.runtime.status. Unexpected exceptions
become INTERNAL with a generic message; the detail goes to the log only.
"""
from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, aclosing
from typing import Any

import grpc
from opentelemetry.trace import Span, SpanKind

from tandem.errors import TandemError
from tandem.runtime import logs, status, tracing
from tandem.runtime.draining import Draining

log = logging.getLogger(__name__)
REQUEST_ID_KEY = "x-request-id"
#: The RPCs that are steps of a request get a server span; health checks, reflection, KV event
#: streams and stats (periodic or long-lived) do not.
TRACED_METHODS = frozenset({
    "/tandem.v1.Inference/Generate", "/tandem.v1.Router/Route", "/tandem.v1.Encode/Encode",
    "/tandem.v1.Prefill/Prefill", "/tandem.v1.Prefill/Release", "/tandem.v1.Decode/Generate",
    "/tandem.v1.Video/Generate"})


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return uuid.uuid4().hex


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, TandemError):
        await context.abort(status.code_for(exc), status.details_for(exc))
    log.error("unhandled error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error (see the service's log)")


def _server_span(context: grpc.aio.ServicerContext, method: str) -> AbstractContextManager[Span]:
    if not tracing.is_enabled() or method not in TRACED_METHODS:
        return tracing.NOOP
    service, _, name = method.lstrip("/").partition("/")
    return tracing.span(method.lstrip("/"), SpanKind.SERVER,
                        {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
                        parent=tracing.extract(context.invocation_metadata() or ()))


def _tracked(draining: Draining | None) -> AbstractContextManager[None]:
    return draining.tracking() if draining is not None else contextlib.nullcontext()


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str,
                draining: Draining | None) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        # grpc.aio runs each RPC in its own task (own context), so no reset is needed.
        logs.request_id_var.set(_request_id(context))
        try:
            # The span records the servicer's own error, then ends before the abort.
            with _tracked(draining), _server_span(context, method):
                return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.aio.BaseError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, exc, method)

    return handler


def _wrap_stream(behavior: Callable[..., AsyncGenerator[Any, None]], method: str,
                 draining: Draining | None) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        logs.request_id_var.set(_request_id(context))
        try:
            with _tracked(draining), _server_span(context, method):
                # aclosing: when the call ends early, the servicer's cleanup (engine abort) runs
                # now, not whenever the garbage collector finalizes its generator.
                async with aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
        except (grpc.aio.AbortError, grpc.aio.BaseError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, exc, method)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, draining: Draining | None = None) -> None:
        #: Request RPCs (TRACED_METHODS) are counted in flight here for the shutdown drain.
        self.draining = draining

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        draining = self.draining if method in TRACED_METHODS else None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, draining),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, draining),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler  # client/bidi streaming: none in the contracts today
