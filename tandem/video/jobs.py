"""Video jobs as a worker keeps them: per-job state that watchers follow without polling, and
the table that remembers finished jobs for a while."""
from __future__ import annotations

import asyncio
import enum
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from tandem.errors import ModelNotFound
from tandem.video.params import ResolvedParams, VideoRequestParams, as_request


class JobNotFound(ModelNotFound):
    """No such job (unknown, or expired from the table): NOT_FOUND, like an unknown model."""


class GenerationCancelled(Exception):
    """Raised from the step hook to stop a generation between two denoising steps."""


class JobStatus(enum.Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclass(frozen=True, slots=True)
class StoredVideo:
    """An MP4 under the media directory."""

    name: str
    num_bytes: int
    sha256: str


@dataclass(frozen=True)
class JobInfo:
    """A job as callers see it (what VideoJob carries)."""

    job_id: str
    model: str
    status: JobStatus
    step: int
    num_steps: int
    queue_position: int
    created_at: float
    finished_at: float
    error: str
    params: VideoRequestParams
    video: StoredVideo | None
    generation_seconds: float


@dataclass(eq=False)
class Job:
    """One generation. Mutated on the event loop only, except `cancel_requested`, which the
    generation thread reads between steps."""

    params: ResolvedParams
    model: str
    #: Store the MP4 (VIDEO_OUTPUT_FILE) rather than hand its bytes to the caller.
    keep_file: bool = True
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: JobStatus = JobStatus.QUEUED
    step: int = 0
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0
    started_at_monotonic: float = 0.0
    generation_seconds: float = 0.0
    error: str = ""
    video: StoredVideo | None = None
    #: The MP4 for a caller that asked for bytes (not kept once delivered).
    data: bytes = b""
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    #: Set (and replaced) at every change: `await job.updated.wait()` after reading the state.
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_steps(self) -> int:
        return self.params.num_inference_steps

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def info(self, queue_position: int = 0) -> JobInfo:
        return JobInfo(self.job_id, self.model, self.status, self.step, self.num_steps,
                       queue_position, self.created_at, self.finished_at, self.error,
                       as_request(self.params), self.video, self.generation_seconds)

    def _notify(self) -> None:
        event, self.updated = self.updated, asyncio.Event()
        event.set()

    def start(self) -> None:
        self.status = JobStatus.IN_PROGRESS
        self.started_at_monotonic = time.monotonic()
        self._notify()

    def advance(self, step: int) -> None:
        if not self.is_finished and step > self.step:
            self.step = step
            self._notify()

    def finish(self, status: JobStatus, error: str = "") -> None:
        """Ends the job (a finished job stays as it is)."""
        if self.is_finished:
            return
        self.status, self.error = status, error
        self.finished_at = time.time()
        if self.started_at_monotonic:
            self.generation_seconds = time.monotonic() - self.started_at_monotonic
        self._notify()


class JobTable:
    """Jobs by id: every unfinished one, and finished ones for `ttl_s` (at most
    `max_finished`, oldest dropped first)."""

    def __init__(self, ttl_s: float, max_finished: int) -> None:
        self.ttl_s = ttl_s
        self.max_finished = max_finished
        self._jobs: OrderedDict[str, Job] = OrderedDict()

    def add(self, job: Job) -> None:
        self.prune()
        self._jobs[job.job_id] = job

    def get(self, job_id: str) -> Job:
        self.prune()
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"no video job '{job_id}' on this worker (unknown or expired)",
                              param="video_id")
        return job

    def unfinished(self) -> list[Job]:
        return [job for job in self._jobs.values() if not job.is_finished]

    def prune(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        finished = [job for job in self._jobs.values() if job.is_finished]
        excess = len(finished) - self.max_finished
        for i, job in enumerate(finished):  # insertion order: oldest first
            if i < excess or now - job.finished_at > self.ttl_s:
                del self._jobs[job.job_id]
