"""/v1/videos routes (aiohttp): HTTP to tandem.video.frontend and back. Errors leave as OpenAI
error JSON; an unknown video is 404 `video_not_found`.

POST /v1/videos                 create: with response_format (Dynamo) wait and answer with
                                data[0].url or b64_json; without (OpenAI), answer the queued job
GET /v1/videos/{id}             the job: status, progress (0-100), parameters
GET /v1/videos/{id}/content     the MP4, streamed (video/mp4)
DELETE /v1/videos/{id}          cancel: the worker stops after the denoising step in flight
"""
from __future__ import annotations

import base64
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.frontend.error_response import error_response
from tandem.errors import InvalidRequest, Unavailable
from tandem.frontend import json_body
from tandem.frontend.errors import error_body
from tandem.runtime import tracing
from tandem.runtime.draining import Draining
from tandem.video import api
from tandem.video.frontend import VideoFrontend
from tandem.video.jobs import JobNotFound
from tandem.video.metrics import VideoFrontendMetrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class VideoRoutes:
    def __init__(self, videos: VideoFrontend, draining: Draining,
                 metrics: VideoFrontendMetrics) -> None:
        self.videos = videos
        self.draining = draining
        self.metrics = metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/videos", self._traced("create", self.create))
        app.router.add_get("/v1/videos/{video_id}", self._traced("retrieve", self.retrieve))
        app.router.add_get("/v1/videos/{video_id}/content",
                           self._traced("content", self.content))
        app.router.add_delete("/v1/videos/{video_id}", self._traced("cancel", self.cancel))

    def model_entry(self) -> dict[str, Any]:
        """The video model as /v1/models lists it."""
        return {"id": self.videos.model, "object": "model", "created": 0, "owned_by": "tandem",
                "kind": "video"}

    def _traced(self, route: str, handler: Handler) -> Handler:
        async def serve(request: web.Request) -> web.StreamResponse:
            with tracing.span(f"{request.method} /v1/videos", SpanKind.SERVER, {
                    "http.request.method": request.method, "http.route": request.path},
                    parent=tracing.extract(request.headers)) as span:
                try:
                    response = await handler(request)
                except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
                    response = self._error(exc)
                span.set_attribute("http.response.status_code", response.status)
                if response.status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                self.metrics.requests.labels(route, str(response.status)).inc()
                return response
        return serve

    def _error(self, exc: BaseException) -> web.Response:
        if isinstance(exc, JobNotFound):
            return web.json_response(error_body(exc.message, "invalid_request_error",
                                                "video_id", "video_not_found"), status=404)
        return error_response(exc)

    async def _body(self, request: web.Request) -> api.CreateVideo:
        if request.content_type.startswith("multipart/"):
            form = await request.post()
            fields: dict[str, Any] = {k: (v.file.read() if hasattr(v, "file") else v)
                                      for k, v in form.items()}
            return api.parse_create(fields, form=True)
        body = json_body.loads(await request.read())
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        return api.parse_create(body)

    async def create(self, request: web.Request) -> web.StreamResponse:
        if self.draining.active:
            raise Unavailable("the frontend is draining")
        req = await self._body(request)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        if req.response_format is None:
            public_id, job = await self.videos.create_job(req, request_id)
            return web.json_response(api.job_object(public_id, job))
        public_id, done = await self.videos.generate(req, request_id)
        if req.response_format == "b64_json":
            data = {"b64_json": base64.b64encode(done.data).decode()}
        else:
            data = {"url": str(request.url.with_path(f"/v1/videos/{public_id}/content")
                               .with_query(None))}
        return web.json_response(api.dynamo_response(public_id, done.job, data))

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        public_id = request.match_info["video_id"]
        return web.json_response(api.job_object(public_id, await self.videos.get(public_id)))

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        public_id = request.match_info["video_id"]
        return web.json_response(api.job_object(public_id, await self.videos.cancel(public_id)))

    async def content(self, request: web.Request) -> web.StreamResponse:
        total, chunks = await self.videos.content(request.match_info["video_id"])
        response = web.StreamResponse(headers={"Content-Type": "video/mp4",
                                               "Content-Length": str(total)})
        try:
            await response.prepare(request)
            async for chunk in chunks:
                await response.write(chunk)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        await response.write_eof()
        return response
