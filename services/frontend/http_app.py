"""OpenAI-compatible REST API (aiohttp). Routes translate HTTP to the frontend library and back;
errors leave as OpenAI error JSON with the status from tandem.frontend.errors."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.frontend.error_response import error_response
from services.frontend.first_delta import first_delta, marking_first
from services.frontend.openapi import openapi_document
from tandem.errors import TandemError, Unauthenticated, Unavailable
from tandem.frontend import json_body
from tandem.frontend.anthropic_errors import anthropic_error, error_body
from tandem.frontend.auth import ApiKeys
from tandem.frontend.errors import http_error
from tandem.frontend.metrics import CLIENT_CLOSED, RequestTracker
from tandem.frontend.openai_request import Kind, parse_request
from tandem.frontend.openai_stream import OpenAIResponder
from tandem.frontend.pipeline import Delta
from tandem.frontend.served_models import ServedModels
from tandem.runtime import logs, tracing
from tandem.runtime.draining import Draining

log = logging.getLogger(__name__)
OPENAPI = openapi_document()
#: Probes and scrapers reach these without an API key; they reveal no model output.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/openapi.json"})
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


def _decision_headers(delta: Delta | None) -> dict[str, str]:
    """Which pool and worker served the request (x-tandem-*), for clients and load tests."""
    if delta is None or delta.worker is None:
        return {}
    return {"x-tandem-decode-worker": delta.worker.worker_id, "x-tandem-pool": delta.worker.pool}


def _sse(event: dict) -> bytes:
    # orjson: compact UTF-8 JSON, several times cheaper than json.dumps on the per-token path.
    return b"data: " + orjson.dumps(event) + b"\n\n"


class OpenAIRoutes:
    def __init__(self, models: ServedModels, draining: Draining) -> None:
        self.served = models
        self.draining = draining
        #: The process's metrics (one registry for every model), labelled with the first.
        self.metrics = models.default.pipeline.metrics
        #: Further /v1/models entries (the video model, with its "kind").
        self.extra_models: list[dict[str, object]] = []

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/openapi.json", self.openapi)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat", "chat_completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion", "completions")

    def _error(self, exc: BaseException, tracker: RequestTracker) -> web.Response:
        return error_response(exc, tracker)

    async def _serve(self, request: web.Request, kind: Kind, endpoint: str) -> web.StreamResponse:
        """One request inside its metrics and its trace (a child of the client's traceparent)."""
        tracker = self.metrics.track(endpoint)
        attributes = {"http.request.method": request.method, "http.route": request.path}
        with tracing.span(f"{request.method} {request.path}", SpanKind.SERVER, attributes,
                          parent=tracing.extract(request.headers)) as span:
            try:
                response = await self._respond(request, kind, tracker)
            except web.HTTPException as exc:
                tracker.finish(str(exc.status))
                raise
            except (asyncio.CancelledError, ConnectionResetError):
                tracker.finish(CLIENT_CLOSED)
                raise
            except BaseException:
                tracker.finish("500")
                raise
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:  # HTTP semantic conventions: 4xx is the client's doing
                span.set_status(Status(StatusCode.ERROR))
            return response

    async def _respond(self, request: web.Request, kind: Kind,
                       tracker: RequestTracker) -> web.StreamResponse:
        try:
            if self.draining.active:
                raise Unavailable("the frontend is draining")
            body = json_body.loads(await request.read())
            parsed = parse_request(body, kind, request.headers)
            frontend = self.served.get(parsed.model)
            tracker.relabel(frontend.pipeline.metrics)
            gen = await frontend.prepare(parsed, parsed.timeout_s)
        except web.HTTPException:
            raise  # e.g. 413 from request.read(): json_errors gives it the OpenAI shape
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            return self._error(exc, tracker)
        token = logs.request_id_var.set(gen.request_id)
        client_id = request.headers.get("x-request-id")
        if client_id:
            log.info("request", extra={"client_request_id": client_id})
        responder = OpenAIResponder(parsed, frontend.model.name, frontend.token_text,
                                    lambda: frontend.chat_output(parsed))
        deltas = frontend.generate_choices(gen, parsed.num_generated)
        try:
            if parsed.stream:
                return await self._stream(request, responder, deltas, tracker)
            seen: list[Delta] = []  # the first: its worker goes in the headers
            try:
                body = await responder.collect(marking_first(deltas, tracker, seen))
            except Exception as exc:  # noqa: BLE001
                return self._error(exc, tracker)
            tracker.finish("200", responder.usage)
            return web.json_response(body, headers=_decision_headers(seen[0] if seen else None))
        finally:
            await deltas.aclose()
            logs.request_id_var.reset(token)

    async def _stream(self, request: web.Request, responder: OpenAIResponder,
                      deltas: AsyncIterator[Delta],
                      tracker: RequestTracker) -> web.StreamResponse:
        first = await first_delta(deltas, tracker)
        if isinstance(first, web.Response):
            return first
        response = web.StreamResponse(headers={**_SSE_HEADERS, **_decision_headers(first)})
        await response.prepare(request)
        events = responder.first_events() + responder.delta_events(first)
        try:
            if events:
                await response.write(b"".join(_sse(e) for e in events))
            if first.received_ns:
                tracker.metrics.observe_sse_hop(first.received_ns)
            async for delta in deltas:
                await response.write(b"".join(_sse(e) for e in responder.delta_events(delta)))
                if delta.received_ns:
                    tracker.metrics.observe_sse_hop(delta.received_ns)
        except TandemError as exc:
            status, body = http_error(exc)
            log.warning("stream failed after it started", extra={"status": status})
            tracker.finish(str(status))  # the HTTP status is 200 already; count the failure
            await response.write(_sse(body))
        tracker.finish("200", responder.usage)  # before the last write: a client that saw it sees this
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            *({"id": f.model.name, "object": "model", "created": 0, "owned_by": "tandem",
               "max_model_len": f.model.max_model_len} for f in self.served),
            *self.extra_models]})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining.active:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "healthy", "model": self.served.default.model.name,
                                  "models": [f.model.name for f in self.served]})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            content_type="text/plain", charset="utf-8")


@web.middleware
async def json_errors(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """Unknown routes, wrong methods and oversized bodies answer in OpenAI's error shape too
    (Anthropic's under /v1/messages)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.text is None else exc.text
        if _is_anthropic(request):
            return web.json_response(error_body(exc.status, message), status=exc.status)
        body = {"error": {"message": message,
                          "type": "invalid_request_error", "param": None, "code": None}}
        return web.json_response(body, status=exc.status)


def _is_anthropic(request: web.Request) -> bool:
    """Whether the request is for the Anthropic Messages API (its errors have its shape)."""
    return request.path == "/v1/messages" or request.path.startswith("/v1/messages/")


def api_key_auth(keys: ApiKeys) -> Middleware:
    """401 in OpenAI's error shape (Anthropic's under /v1/messages) for a request without a
    valid API key, sent as `Authorization: Bearer` or `x-api-key` (OPEN_PATHS exempt)."""
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            try:
                keys.check(request.headers.get("Authorization"), request.headers.get("x-api-key"))
            except Unauthenticated as exc:
                status, body = (anthropic_error(exc) if _is_anthropic(request)
                                else http_error(exc))
                return web.json_response(body, status=status,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return auth
