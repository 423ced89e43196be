"""What a video worker's Generate stream says, as the frontend reads it."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.video.jobs import JobInfo


@dataclass(frozen=True)
class Accepted:
    """The worker took the job (queued)."""

    job: JobInfo


@dataclass(frozen=True)
class Step:
    step: int
    num_steps: int


@dataclass(frozen=True)
class Finished:
    """The job completed."""

    job: JobInfo
    #: The MP4 (bytes output only; empty when the worker stored it).
    data: bytes


VideoEvent = Accepted | Step | Finished
