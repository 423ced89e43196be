"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) over the same
models and pipeline as Chat Completions: the request is translated into a chat request
(tandem.frontend.responses_request), its deltas rendered as a response object or its stream
events (tandem.frontend.responses_output), completed responses kept in a ResponseStore."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from services.frontend.error_response import error_response
from services.frontend.first_delta import first_delta, marking_first
from tandem.errors import TandemError, Unavailable
from tandem.frontend import json_body
from tandem.frontend import responses_shapes as shapes
from tandem.frontend.errors import http_error
from tandem.frontend.metrics import CLIENT_CLOSED, RequestTracker
from tandem.frontend.pipeline import Delta
from tandem.frontend.responses_output import ResponseBuilder
from tandem.frontend.responses_request import conversation, parse_chat, parse_responses
from tandem.frontend.responses_store import ResponseNotFound, ResponseStore, StoredResponse
from tandem.frontend.served_models import ServedModels
from tandem.runtime import logs
from tandem.runtime.draining import Draining

log = logging.getLogger(__name__)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}




class ResponsesRoutes:
    def __init__(self, models: ServedModels, draining: Draining, store: ResponseStore) -> None:
        self.models = models
        self.draining = draining
        self.store = store

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def retrieve(self, request: web.Request) -> web.Response:
        try:
            stored = self.store.get(request.match_info["response_id"])
        except ResponseNotFound as exc:
            return error_response(exc)
        return web.json_response(stored.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        try:
            self.store.delete(response_id)
        except ResponseNotFound as exc:
            return error_response(exc)
        return web.json_response(shapes.deleted(response_id))

    async def create(self, request: web.Request) -> web.StreamResponse:
        tracker = self.models.default.pipeline.metrics.track("responses")
        try:
            return await self._create(request, tracker)
        except (asyncio.CancelledError, ConnectionResetError):
            tracker.finish(CLIENT_CLOSED)
            raise
        except web.HTTPException as exc:
            tracker.finish(str(exc.status))
            raise
        except BaseException:
            tracker.finish("500")
            raise

    async def _create(self, request: web.Request, tracker: RequestTracker) -> web.StreamResponse:
        try:
            if self.draining.active:
                raise Unavailable("the frontend is draining")
            body = json_body.loads(await request.read())
            req = parse_responses(body, self.store.history)
            req.store = req.store and self.store.is_enabled
            req.echo["store"] = req.store
            frontend = self.models.get(req.model)
            tracker.relabel(frontend.pipeline.metrics)
            parsed = parse_chat(req, request.headers)
            try:
                gen = await frontend.prepare(parsed, parsed.timeout_s)
            except TandemError as exc:
                raise req.chat_error(exc) from None
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            return error_response(exc, tracker)
        token = logs.request_id_var.set(gen.request_id)
        builder = ResponseBuilder(req, frontend.model.name, frontend.chat_output(parsed))
        deltas = frontend.generate_choices(gen, 1)
        try:
            if req.stream:
                response = await self._stream(request, builder, deltas, tracker)
            else:
                try:
                    async for delta in marking_first(deltas, tracker):
                        builder.delta_events(delta)
                except Exception as exc:  # noqa: BLE001
                    return error_response(exc, tracker)
                tracker.finish("200", builder.usage)
                response = web.json_response(builder.response())
            if req.store and builder.status in ("completed", "incomplete"):
                self.store.put(StoredResponse(builder.response(), list(conversation(req))))
            return response
        finally:
            await deltas.aclose()
            logs.request_id_var.reset(token)

    async def _stream(self, request: web.Request, builder: ResponseBuilder,
                      deltas: AsyncIterator[Delta],
                      tracker: RequestTracker) -> web.StreamResponse:
        first = await first_delta(deltas, tracker)
        if isinstance(first, web.Response):
            return first
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        events = builder.first_events() + builder.delta_events(first)
        try:
            await response.write(b"".join(shapes.sse(e) for e in events))
            async for delta in deltas:
                await response.write(b"".join(shapes.sse(e) for e in builder.delta_events(delta)))
        except TandemError as exc:
            status, body = http_error(exc)
            log.warning("stream failed after it started", extra={"status": status})
            tracker.finish(str(status))
            await response.write(b"".join(shapes.sse(e) for e in builder.failed_events(
                "server_error", body["error"]["message"])))
            return response
        tracker.finish("200", builder.usage)
        return response
