"""A video worker's scheduler: a bounded queue of jobs, one generation at a time on a thread of
its own, MP4 encoding on another (overlapping the next generation), cancellation between
denoising steps, and the progress a health watchdog reads.

The engine's pipeline holds per-call state (its scheduler's timesteps), so generations never
overlap; a GPU serves one job at a time and the queue orders the rest (first come, first
served). A job whose frames are made hands them to the `Mp4Writer` and the GPU takes the next
job; the job completes when its MP4 is stored. Cancelling a queued job removes it at once;
cancelling a running one sets a flag the step hook reads after the step in flight, so the
worker is free again within one step; a cancellation that comes after the last step (while the
VAE decodes or the MP4 encodes) does not stop the job, as before encoding overlapped.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engines.base import Progress
from tandem.engines.types import EngineStats
from tandem.errors import (
    FailedPrecondition,
    Overloaded,
    TandemError,
    Unavailable,
    Unimplemented,
)
from tandem.video import mp4
from tandem.video.encoding import EncodeFailed, Mp4Writer
from tandem.video.engine import VideoEngine
from tandem.video.jobs import GenerationCancelled, Job, JobStatus, JobTable, StoredVideo
from tandem.video.params import VideoLimits, VideoRequestParams, resolve
from tandem.video.storage import MediaStore

if TYPE_CHECKING:
    import numpy as np

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
    #: H.264 encoder; None: the first usable of `mp4.PREFERENCE` (NVENC, then libx264).
    encoder: mp4.H264Encoder | None = None
    #: Jobs whose frames may wait for or be in the encoder at once (frames of a 832x480x33
    #: video: 40 MB); past it the next generation waits to hand its frames over.
    max_pending_encodes: int = 1


class VideoRunner:
    def __init__(self, engine: VideoEngine, store: MediaStore, config: RunnerConfig,
                 observer: JobObserver = lambda job: None, writer: Mp4Writer | None = None
                 ) -> None:
        self.engine = engine
        self.store = store
        self.writer = writer or Mp4Writer(store, config.encoder, config.max_pending_encodes)
        self.config = config
        self.observer = observer
        self.jobs = JobTable(config.job_ttl_s, config.max_finished_jobs)
        self.draining = False
        self._queue: collections.deque[Job] = collections.deque()
        self._queued = asyncio.Event()
        self._running: Job | None = None
        #: Jobs generated, their MP4 not yet stored, and the tasks writing them.
        self._writing: dict[Job, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        #: Steps started (and jobs begun) since start: the watchdog's proof of progress.
        self._num_steps = 0
        #: Cleared by the debug hook to hold the denoising loop before its next step.
        self._unpaused = threading.Event()
        self._unpaused.set()
        # One thread: generations never overlap.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Loads the engine (on the generation thread), picks the H.264 encoder and starts
        taking jobs."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.load)
        encoder = await self.writer.start()
        log.info("video encoder", extra={"codec": encoder.codec, "options": dict(encoder.options),
                                         "max_pending": self.config.max_pending_encodes})
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
        return Progress(has_work=bool(self._queue) or self._running is not None
                        or bool(self._writing), num_steps=self._num_steps)

    def stats(self) -> EngineStats:
        """Running: the generating job and those whose MP4 is being written."""
        return EngineStats(num_running=int(self._running is not None) + len(self._writing),
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
        """Generates, then hands the frames to the writer: the GPU is free when this returns."""
        frames: np.ndarray | None = None
        with self._ending_on_error(job, "generation"):
            frames = await self._generate(job)
        if frames is None:
            return
        await self.writer.reserve()  # the backpressure: the frames held stay bounded
        self._writing[job] = asyncio.get_running_loop().create_task(
            self._write(job, frames), name=f"video-write-{job.job_id}")

    async def _generate(self, job: Job) -> np.ndarray:
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

        return await loop.run_in_executor(self._executor, self.engine.generate, job.params,
                                          on_step)

    async def _write(self, job: Job, frames: np.ndarray) -> None:
        try:
            with self._ending_on_error(job, "MP4 encoding"):
                await self.writer.write(job, frames)
                job.step = job.num_steps
                self._finish(job, JobStatus.COMPLETED)
        finally:
            del self._writing[job]
            self._num_steps += 1  # a job done is progress too (the watchdog's proof)

    @contextlib.contextmanager
    def _ending_on_error(self, job: Job, stage: str) -> Iterator[None]:
        """Ends the job by what the block raised: a failed job, never a dead worker."""
        try:
            yield
        except GenerationCancelled:
            self._finish(job, JobStatus.CANCELLED, job.error or "cancelled")
        except TandemError as exc:
            self._finish(job, JobStatus.FAILED, exc.message)
        except EncodeFailed as exc:
            log.error("MP4 encoding failed", extra={"job": job.job_id, "reason": str(exc)},
                      exc_info=exc.__cause__)
            self._finish(job, JobStatus.FAILED, f"the MP4 encoding failed ({exc})")
        except Exception:  # noqa: BLE001 - a failed job, never a dead worker
            log.exception(f"video {stage} failed", extra={"job": job.job_id})
            self._finish(job, JobStatus.FAILED, f"the {stage} failed (see the worker's log)")

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
        """Refuses new jobs, lets accepted ones finish (MP4 stored) for `timeout_s`, then
        cancels the rest (the running one within a step) and waits for the encodes."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._until_idle(), timeout_s)
        for job in self.jobs.unfinished():
            self.cancel(job.job_id, "the worker shut down before the job finished")
        started = [job for job in (self._running, *self._writing) if job is not None]
        if started:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*map(self._wait_finished, started)), 60)

    async def _until_idle(self) -> None:
        await self._idle.wait()
        while self._writing:
            await asyncio.wait(list(self._writing.values()))

    @staticmethod
    async def _wait_finished(job: Job) -> None:
        while not job.is_finished:
            updated = job.updated
            await updated.wait()

    async def close(self) -> None:
        tasks = [*self._writing.values(), *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.close)
        self._executor.shutdown(wait=False)
        self.writer.close()
