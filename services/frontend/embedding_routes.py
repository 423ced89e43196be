"""`POST /v1/embeddings`: the body to an EmbeddingRequest, the named embedding model's Embedder
(inside an admission slot), its answer as OpenAI's embeddings object; errors as OpenAI error
JSON."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from services.frontend.error_response import error_response
from tandem.engines.types import Usage
from tandem.errors import InvalidRequest, Unavailable
from tandem.frontend import json_body
from tandem.frontend.embeddings import embedding_response, parse_embedding_request
from tandem.frontend.metrics import CLIENT_CLOSED
from tandem.frontend.served_models import ServedModels
from tandem.runtime.draining import Draining


class EmbeddingRoutes:
    def __init__(self, models: ServedModels, draining: Draining) -> None:
        self.served = models
        self.draining = draining

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)

    async def embeddings(self, request: web.Request) -> web.Response:
        tracker = self.served.default.pipeline.metrics.track("embeddings")
        try:
            if self.draining.active:
                raise Unavailable("the frontend is draining")
            req = parse_embedding_request(json_body.loads(await request.read()))
            frontend = self.served.get(req.model)
            tracker.relabel(frontend.pipeline.metrics)
            embedder = frontend.embedder
            if embedder is None:
                raise InvalidRequest(f"model '{req.model}' generates text; it has no embedding "
                                     "workers", param="model")
            timeout_s = frontend.request_timeout_s
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            async with frontend.admission.slot(deadline):
                result = await embedder.embed(req, timeout_s)
        except web.HTTPException:
            raise  # e.g. 413: json_errors gives it the OpenAI shape
        except (asyncio.CancelledError, ConnectionResetError):
            tracker.finish(CLIENT_CLOSED)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            return error_response(exc, tracker)
        tracker.finish("200", Usage(result.prompt_tokens, 0))
        return web.json_response(embedding_response(req.model, result, req.encoding_format))
