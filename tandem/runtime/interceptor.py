"""The server interceptor every Tandem service installs.

It binds the request id (metadata `x-request-id`, else a fresh one) to the log context and maps
typed errors to status codes from tandem.runtime.status. Unexpected exceptions become INTERNAL
with a generic message; the detail goes to the log only.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc

from tandem.errors import TandemError
from tandem.runtime import logs, status

log = logging.getLogger(__name__)
REQUEST_ID_KEY = "x-request-id"


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return uuid.uuid4().hex


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, TandemError):
        await context.abort(status.code_for(exc), exc.message)
    log.error("unhandled error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error (see the service's log)")


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        # grpc.aio runs each RPC in its own task (own context), so no reset is needed.
        logs.request_id_var.set(_request_id(context))
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.aio.BaseError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, exc, method)

    return handler


def _wrap_stream(behavior: Callable[..., AsyncGenerator[Any, None]],
                 method: str) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        logs.request_id_var.set(_request_id(context))
        try:
            # aclosing: when the call ends early, the servicer's cleanup (engine abort) runs now,
            # not whenever the garbage collector finalizes its generator.
            async with aclosing(behavior(request, context)) as items:
                async for item in items:
                    yield item
        except (grpc.aio.AbortError, grpc.aio.BaseError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, exc, method)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler  # client/bidi streaming: none in the contracts today
