"""A video worker's scheduler: a bounded queue of jobs, one generation at a time on a thread of
its own, cancellation between denoising steps, and the progress a health watchdog reads.

The engine's pipeline holds per-call state (its scheduler's timesteps), so generations never
overlap; a GPU serves one job at a time and the queue orders the rest (first come, first
served). Cancelling a queued job removes it at once; cancelling a running one sets a flag the
step hook reads after the step in flight, so the worker is free again within one step.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.engines.base import Progress
from tandem.engines.types import EngineStats
from tandem.errors import (
    FailedPrecondition,
    InvalidRequest,
    Overloaded,
    TandemError,
    Unavailable,
    Unimplemented,
)
from tandem.video import mp4
from tandem.video.engine import VideoEngine
from tandem.video.jobs import GenerationCancelled, Job, JobStatus, JobTable, StoredVideo
from tandem.video.params import VideoLimits, VideoRequestParams, resolve
from tandem.video.storage import MediaStore

log = logging.getLogger(__name__)
#: Told of every finished job (metrics).
JobObserver = Callable[[Job], None]


@dataclass(frozen=True)
class RunnerConfig:
    model: str
    limits: VideoLimits
    max_queued: int = 8
    job_ttl_s: float = 3600.0
    max_finished_jobs: int = 1000


class VideoRunner:
    def __init__(self, engine: VideoEngine, store: MediaStore, config: RunnerConfig,
                 observer: JobObserver = lambda job: None) -> None:
        self.engine = engine
        self.store = store
        self.config = config
        self.observer = observer
        self.jobs = JobTable(config.job_ttl_s, config.max_finished_jobs)
        self.draining = False
        self._queue: collections.deque[Job] = collections.deque()
        self._queued = asyncio.Event()
        self._running: Job | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        #: Steps started (and jobs begun) since start: the watchdog's proof of progress.
        self._num_steps = 0
        #: Cleared by the debug hook to hold the denoising loop before its next step.
        self._unpaused = threading.Event()
        self._unpaused.set()
        # One thread: generations never overlap, and MP4 encoding follows its generation.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Loads the engine (on the generation thread) and starts taking jobs."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.load)
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="video-runner")

    # == admission ==
    def submit(self, request: VideoRequestParams, keep_file: bool = True) -> Job:
        """Validates and queues a job.

        Raises:
            InvalidRequest: a parameter out of range for this worker or model.
            Unavailable: the worker is draining.
            Overloaded: the queue is full.
        """
        if self.draining:
            raise Unavailable("video worker is draining")
        params = resolve(request, self.config.limits, self.engine.spec)
        if len(self._queue) >= self.config.max_queued:
            raise Overloaded(f"video queue is full ({self.config.max_queued} jobs waiting)")
        job = Job(params, self.config.model, keep_file)
        self.jobs.add(job)
        self._queue.append(job)
        self._idle.clear()
        self._queued.set()
        return job

    def queue_position(self, job: Job) -> int:
        return self._queue.index(job) if job in self._queue else 0

    def cancel(self, job_id: str, reason: str = "cancelled by the client") -> Job:
        """Cancels a job: a queued one now, a running one after its current step."""
        job = self.jobs.get(job_id)
        if job in self._queue:
            self._queue.remove(job)
            self._finish(job, JobStatus.CANCELLED, reason)
        elif not job.is_finished:
            job.error = reason
            job.cancel_requested.set()
        return job

    def video_of(self, job_id: str) -> StoredVideo:
        """The stored MP4 of a completed job.

        Raises:
            JobNotFound: no such job.
            FailedPrecondition: the job has not completed, or returned its bytes instead.
        """
        job = self.jobs.get(job_id)
        if job.status is not JobStatus.COMPLETED:
            raise FailedPrecondition(f"video job {job_id} is {job.status.value}, not completed",
                                     param="video_id")
        if job.video is None:
            raise FailedPrecondition(f"video job {job_id} returned its video inline; nothing "
                                     "was stored", param="video_id")
        return job.video

    async def follow(self, job: Job) -> AsyncIterator[int]:
        """Yields the job's step count each time it grows, until the job finishes."""
        last = job.step
        while True:
            updated = job.updated
            if job.step != last:
                last = job.step
                yield last
            if job.is_finished:
                return
            await updated.wait()

    # == health and load ==
    def progress(self) -> Progress:
        return Progress(has_work=bool(self._queue) or self._running is not None,
                        num_steps=self._num_steps)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=int(self._running is not None),
                           num_waiting=len(self._queue), kv_blocks_used=0, kv_blocks_total=0,
                           pending_prefill_tokens=0, active_decode_blocks=0,
                           prefix_cache_hit_rate=0.0)

    async def health_canary(self, timeout_s: float) -> None:
        """Progress (steps while jobs wait) is the proof here; no canary video."""
        raise Unimplemented("the video runner proves progress by its steps")

    def pause_steps(self) -> None:
        self._unpaused.clear()

    def resume_steps(self) -> None:
        self._unpaused.set()

    # == the generation loop ==
    async def _serve(self) -> None:
        while True:
            while not self._queue:
                self._queued.clear()
                self._idle.set()
                await self._queued.wait()
            job = self._queue.popleft()
            self._running = job
            try:
                await self._run(job)
            finally:
                self._running = None

    async def _run(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        job.start()
        self._num_steps += 1

        def on_step(step: int, num_steps: int) -> None:  # on the generation thread
            # Held by the debug hook: wait, but let a cancellation through (checked at 20 Hz:
            # a test-only path).
            while not self._unpaused.wait(0.05):
                if job.cancel_requested.is_set():
                    break
            if job.cancel_requested.is_set():
                raise GenerationCancelled
            loop.call_soon_threadsafe(self._on_step, job, step)

        try:
            frames = await loop.run_in_executor(self._executor, self.engine.generate,
                                                job.params, on_step)
            data = await loop.run_in_executor(self._executor, mp4.encode_mp4, frames,
                                              job.params.fps)
            if job.keep_file:
                job.video = await loop.run_in_executor(self._executor, self.store.put, data)
            elif len(data) > self.store.max_bytes:
                raise InvalidRequest(f"the video is {len(data)} bytes, more than this worker "
                                     f"returns ({self.store.max_bytes})")
            else:
                job.data = data
        except GenerationCancelled:
            self._finish(job, JobStatus.CANCELLED, job.error or "cancelled")
            return
        except TandemError as exc:
            self._finish(job, JobStatus.FAILED, exc.message)
            return
        except Exception:  # noqa: BLE001 - a failed job, never a dead worker
            log.exception("video generation failed", extra={"job": job.job_id})
            self._finish(job, JobStatus.FAILED, "the generation failed (see the worker's log)")
            return
        job.step = job.num_steps
        self._finish(job, JobStatus.COMPLETED)

    def _on_step(self, job: Job, step: int) -> None:
        self._num_steps += 1
        job.advance(step)

    def _finish(self, job: Job, status: JobStatus, error: str = "") -> None:
        job.finish(status, error)
        log.info("video job finished", extra={
            "job": job.job_id, "status": status.value, "step": job.step,
            "num_steps": job.num_steps, "seconds": round(job.generation_seconds, 3)})
        self.observer(job)

    # == shutdown ==
    async def drain(self, timeout_s: float) -> None:
        """Refuses new jobs, lets accepted ones finish for `timeout_s`, then cancels the rest
        (the running one within a step)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0))
        for job in self.jobs.unfinished():
            self.cancel(job.job_id, "the worker shut down before the job finished")
        running = self._running
        if running is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_finished(running), 60)

    @staticmethod
    async def _wait_finished(job: Job) -> None:
        while not job.is_finished:
            updated = job.updated
            await updated.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.close)
        self._executor.shutdown(wait=False)
