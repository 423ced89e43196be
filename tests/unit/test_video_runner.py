"""The video worker's runner with a scripted engine whose every denoising step waits for the
test's go-ahead: cancellation lands within one step and frees the worker, the queue is bounded,
a queued job cancels at once, draining refuses new jobs, and progress proves steps."""
from __future__ import annotations

import asyncio
import pathlib
import threading

import numpy as np
import pytest

from tandem.errors import Overloaded, Unavailable
from tandem.video.engine import StepHook, VideoEngine
from tandem.video.jobs import JobStatus
from tandem.video.params import PipelineSpec, ResolvedParams, VideoLimits, VideoRequestParams
from tandem.video.runner import RunnerConfig, VideoRunner
from tandem.video.storage import MediaStore


class SteppedEngine(VideoEngine):
    """Each step waits on a semaphore the test releases; records the steps it ran."""

    name = "stepped"

    def __init__(self) -> None:
        self.go = threading.Semaphore(0)
        self.steps_run = 0

    @property
    def spec(self) -> PipelineSpec:
        return PipelineSpec()

    def load(self) -> None:
        pass

    def generate(self, params: ResolvedParams, on_step: StepHook) -> np.ndarray:
        for step in range(1, params.num_inference_steps + 1):
            assert self.go.acquire(timeout=10)
            self.steps_run += 1
            on_step(step, params.num_inference_steps)
        return np.zeros((params.num_frames, params.height, params.width, 3), np.uint8)


def _request(steps: int) -> VideoRequestParams:
    return VideoRequestParams("a cat", width=16, height=16, num_frames=1,
                              num_inference_steps=steps, seed=0)


@pytest.fixture
async def runner(tmp_path: pathlib.Path):  # noqa: ANN201 - async fixture
    engine = SteppedEngine()
    runner = VideoRunner(engine, MediaStore(tmp_path, 10**6),
                         RunnerConfig("m", VideoLimits(), max_queued=1))
    await runner.start()
    yield runner
    engine.go.release(1000)
    await runner.close()


async def _until_step(runner: VideoRunner, job_id: str, step: int) -> None:
    job = runner.jobs.get(job_id)
    async for seen in runner.follow(job):
        if seen >= step:
            return


async def test_a_job_completes_with_every_step(runner: VideoRunner) -> None:
    engine = runner.engine
    assert isinstance(engine, SteppedEngine)
    job = runner.submit(_request(3))
    engine.go.release(3)
    seen = [step async for step in runner.follow(job)]
    assert job.status is JobStatus.COMPLETED and seen[-1] == 3 and seen == sorted(seen)
    assert job.video is not None and runner.store.size_of(job.video.name) == job.video.num_bytes


async def test_cancel_stops_within_one_step_and_frees_the_worker(runner: VideoRunner) -> None:
    engine = runner.engine
    assert isinstance(engine, SteppedEngine)
    job = runner.submit(_request(50))
    engine.go.release(2)
    await _until_step(runner, job.job_id, 2)
    runner.cancel(job.job_id)
    engine.go.release(1)  # the step in flight when the cancel came ends; no further one starts
    async for _ in runner.follow(job):
        pass
    assert job.status is JobStatus.CANCELLED and job.step == 2
    assert engine.steps_run == 3
    second = runner.submit(_request(1))  # the worker is free again
    engine.go.release(1)
    async for _ in runner.follow(second):
        pass
    assert second.status is JobStatus.COMPLETED


async def test_queue_is_bounded_and_a_queued_job_cancels_at_once(runner: VideoRunner) -> None:
    running = runner.submit(_request(1))
    await asyncio.sleep(0)  # the loop takes it off the queue
    while runner.stats().num_running == 0:
        await asyncio.sleep(0.01)
    queued = runner.submit(_request(1))
    assert runner.queue_position(queued) == 0 and runner.stats().num_waiting == 1
    with pytest.raises(Overloaded):
        runner.submit(_request(1))
    runner.cancel(queued.job_id)
    assert queued.status is JobStatus.CANCELLED and runner.stats().num_waiting == 0
    assert not running.is_finished


async def test_progress_counts_steps_and_drain_refuses_new_jobs(runner: VideoRunner) -> None:
    engine = runner.engine
    assert isinstance(engine, SteppedEngine)
    before = runner.progress()
    assert not before.has_work
    job = runner.submit(_request(2))
    engine.go.release(1)
    await _until_step(runner, job.job_id, 1)
    during = runner.progress()
    assert during.has_work and during.num_steps > before.num_steps
    drain = asyncio.ensure_future(runner.drain(timeout_s=5))
    while not runner.draining:
        await asyncio.sleep(0)
    with pytest.raises(Unavailable):
        runner.submit(_request(1))
    engine.go.release(1)
    await drain
    assert job.status is JobStatus.COMPLETED
