"""The frontend's video logic: pick a worker through the router's video pool, start the job, and
serve both API forms.

- OpenAI's job form: the job starts detached (it survives this process and the client), the
  answer is the queued job at once, and a background task follows it to its end only to release
  the router's count and record metrics. GET/DELETE/content reach the worker named in the id.
- Dynamo's synchronous form: `url` also starts a detached, stored job (a client that drops the
  connection can still fetch it by id) and waits for it; `b64_json` asks the worker for the
  bytes (nothing stored) and cancels the job if the client goes away.

A worker whose queue is full (or that is draining) is skipped for the next one the router
offers; when none is left, the last such error reaches the client (429 or 503).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from tandem.errors import ModelNotFound, Overloaded, TandemError, Unavailable, UpstreamError
from tandem.routing.workers import WorkerRef
from tandem.runtime.tasks import spawn
from tandem.video import job_ids
from tandem.video.api import CreateVideo
from tandem.video.events import Accepted, Finished, VideoEvent
from tandem.video.jobs import JobInfo, JobNotFound
from tandem.video.metrics import VideoFrontendMetrics
from tandem.video.params import VideoRequestParams

log = logging.getLogger(__name__)


class VideoRouter(Protocol):
    async def route_video(self, request_id: str, exclude_ids: tuple[str, ...] = ()
                          ) -> tuple[WorkerRef, ...]: ...

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None: ...


class VideoWorkers(Protocol):
    def generate(self, address: str, request_id: str, model: str, params: VideoRequestParams,
                 keep_file: bool, detach: bool) -> AsyncGenerator[VideoEvent, None]: ...

    async def get_job(self, address: str, job_id: str) -> JobInfo: ...

    async def cancel_job(self, address: str, job_id: str) -> JobInfo: ...

    def read_video(self, address: str, job_id: str
                   ) -> AsyncGenerator[tuple[bytes, int], None]: ...

    async def is_video_worker(self, address: str) -> bool: ...


@dataclass
class Started:
    public_id: str
    job: JobInfo
    events: AsyncGenerator[VideoEvent, None]
    started_at: float


class VideoFrontend:
    def __init__(self, model: str, router: VideoRouter, workers: VideoWorkers,
                 metrics: VideoFrontendMetrics | None = None) -> None:
        self.model = model
        self.router = router
        self.workers = workers
        self.metrics = metrics
        self._followers: set[asyncio.Task[None]] = set()

    def check_model(self, model: str) -> None:
        if model and model != self.model:
            raise ModelNotFound(f"the model '{model}' does not exist here; the video model is "
                                f"'{self.model}'", param="model")

    async def _start(self, req: CreateVideo, request_id: str, keep_file: bool,
                     detach: bool) -> Started:
        self.check_model(req.model)
        tried: list[str] = []
        busy: TandemError | None = None
        while True:
            try:
                workers = await self.router.route_video(request_id, tuple(tried))
            except Unavailable:
                raise busy or Unavailable("no video worker is available") from None
            pick = workers[0]
            events = self.workers.generate(pick.address, request_id, self.model, req.params,
                                           keep_file, detach)
            try:
                first = await anext(events)
            except (Overloaded, Unavailable) as exc:  # full queue or draining: the next one
                await events.aclose()
                self.router.report_completion(request_id, "error", 0)
                busy, tried = exc, [*tried, pick.worker_id]
                continue
            except BaseException:
                await events.aclose()
                self.router.report_completion(request_id, "error", 0)
                raise
            assert isinstance(first, Accepted)
            return Started(job_ids.encode(pick.address, first.job.job_id), first.job, events,
                           time.monotonic())

    async def _finish(self, started: Started, request_id: str) -> Finished:
        """Follows a started job to its end; releases the router's count whatever happens."""
        outcome = "error"
        try:
            async for event in started.events:
                if isinstance(event, Finished):
                    outcome = "ok"
                    return event
            raise UpstreamError("the video worker ended the job's stream without a result")
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            await started.events.aclose()
            self.router.report_completion(request_id, outcome, 0)
            if self.metrics is not None:
                self.metrics.seconds.labels(outcome).observe(time.monotonic()
                                                             - started.started_at)

    async def create_job(self, req: CreateVideo, request_id: str) -> tuple[str, JobInfo]:
        """OpenAI's form: the queued job, at once."""
        started = await self._start(req, request_id, keep_file=True, detach=True)
        spawn(self._follow(started, request_id), self._followers)
        return started.public_id, started.job

    async def _follow(self, started: Started, request_id: str) -> None:
        with contextlib.suppress(TandemError):  # the job's own status says what went wrong
            await self._finish(started, request_id)

    async def generate(self, req: CreateVideo, request_id: str) -> tuple[str, Finished]:
        """Dynamo's form: waits for the video (bytes inline for b64_json)."""
        inline = req.response_format == "b64_json"
        started = await self._start(req, request_id, keep_file=not inline, detach=not inline)
        return started.public_id, await self._finish(started, request_id)

    async def _address(self, public_id: str) -> tuple[str, str]:
        address, job_id = job_ids.decode(public_id)
        if not await self.workers.is_video_worker(address):
            raise JobNotFound(f"no video '{public_id}'", param="video_id")
        return address, job_id

    async def get(self, public_id: str) -> JobInfo:
        return await self.workers.get_job(*await self._address(public_id))

    async def cancel(self, public_id: str) -> JobInfo:
        return await self.workers.cancel_job(*await self._address(public_id))

    async def content(self, public_id: str) -> tuple[int, AsyncIterator[bytes]]:
        """(total bytes, the MP4's chunks); errors (not completed, gone) before any byte."""
        chunks = self.workers.read_video(*await self._address(public_id))
        try:
            first, total = await anext(chunks)
        except StopAsyncIteration:
            raise JobNotFound(f"video '{public_id}' has no content", param="video_id") from None

        async def rest() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk, _ in chunks:
                    yield chunk
            finally:
                await chunks.aclose()
        return total, rest()

    async def close(self) -> None:
        """Stops following jobs (they run on, detached, on their workers)."""
        for task in list(self._followers):
            task.cancel()
        await asyncio.gather(*self._followers, return_exceptions=True)
