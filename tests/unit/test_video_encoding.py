"""MP4 encoding off the GPU's loop, on the tiny random-weight Wan (tandem.model.tiny_wan, CPU)
through the reference engine and the worker's runner, with an encoder the test holds: the next
job denoises while the previous one encodes, frames waiting for the encoder stay bounded, an
encoder error fails only its job, a cancellation lands between denoising steps (one that
comes while the MP4 encodes is too late: the job completes, as before encoding overlapped), and
draining waits for the encode. Also: the encoder is picked by probing, with libx264
as the fallback."""
from __future__ import annotations

import asyncio
import io
import pathlib
import threading
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tandem.model.tiny_wan import write_tiny_wan
from tandem.video import mp4
from tandem.video.config import VideoEngineArgs
from tandem.video.encoding import Mp4Writer
from tandem.video.engine import create_video_engine
from tandem.video.jobs import Job, JobStatus
from tandem.video.params import VideoLimits, VideoRequestParams
from tandem.video.runner import RunnerConfig, VideoRunner
from tandem.video.storage import MediaStore


class HeldEncoder:
    """libx264, but each encode waits for the test's go-ahead; records what it saw."""

    def __init__(self, fail: bool = False) -> None:
        self.go = threading.Semaphore(0)
        self.started = threading.Semaphore(0)
        self.fail = fail
        self.num_encoded = 0
        self.dtypes: list[np.dtype] = []

    def __call__(self, frames: np.ndarray, fps: int, encoder: mp4.H264Encoder) -> bytes:
        self.dtypes.append(frames.dtype)
        self.started.release()
        assert self.go.acquire(timeout=30)
        if self.fail:
            raise RuntimeError("the encoder broke")
        self.num_encoded += 1
        return mp4.encode_mp4(frames, fps, encoder)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_wan(tmp_path_factory.mktemp("wan") / "wan-tiny", seed=0)


@pytest.fixture
def encoder() -> HeldEncoder:
    return HeldEncoder()


@pytest.fixture
async def runner(wan_dir: pathlib.Path, tmp_path: pathlib.Path,
                 encoder: HeldEncoder) -> AsyncIterator[VideoRunner]:
    store = MediaStore(tmp_path / "media", 10**7)
    engine = create_video_engine("reference", VideoEngineArgs(model=str(wan_dir)))
    runner = VideoRunner(engine, store, RunnerConfig("wan", VideoLimits(), max_queued=4),
                         writer=Mp4Writer(store, mp4.X264, max_pending=1, encode=encoder))
    await runner.start()
    yield runner
    encoder.go.release(100)
    await runner.close()


def _request(seed: int = 0, steps: int = 2) -> VideoRequestParams:
    return VideoRequestParams("a cat", width=32, height=32, num_frames=5,
                              num_inference_steps=steps, seed=seed)


async def _encode_started(encoder: HeldEncoder) -> None:
    assert await asyncio.to_thread(encoder.started.acquire, timeout=30)


async def _until_step(runner: VideoRunner, job: Job, step: int) -> None:
    async for seen in runner.follow(job):
        if seen >= step:
            return


async def _finished(runner: VideoRunner, job: Job) -> Job:
    async for _ in runner.follow(job):
        pass
    return job


def _stored(runner: VideoRunner) -> list[str]:
    return sorted(p.name for p in runner.store.root.iterdir())


async def test_next_job_denoises_while_the_previous_one_encodes(
        runner: VideoRunner, encoder: HeldEncoder) -> None:
    first, second = runner.submit(_request(seed=1)), runner.submit(_request(seed=2, steps=3))
    await _encode_started(encoder)
    # The first job's encode is held: the second still runs every denoising step.
    await _until_step(runner, second, second.num_steps)
    assert first.status is JobStatus.IN_PROGRESS and first.video is None
    assert runner.stats().num_running == 2
    encoder.go.release(2)
    await _finished(runner, first)
    await _finished(runner, second)
    assert first.status is second.status is JobStatus.COMPLETED
    assert first.step == first.num_steps and encoder.dtypes == [np.uint8, np.uint8]
    assert first.video is not None and second.video is not None
    assert first.video.name != second.video.name
    assert _stored(runner) == sorted([first.video.name, second.video.name])
    import av

    data = b"".join(runner.store.read(first.video.name))
    with av.open(io.BytesIO(data)) as container:
        assert len(list(container.decode(video=0))) == 5


async def test_frames_waiting_for_the_encoder_are_bounded(runner: VideoRunner,
                                                          encoder: HeldEncoder) -> None:
    jobs = [runner.submit(_request(seed=i, steps=1)) for i in range(3)]
    await _encode_started(encoder)
    # Job 1 encodes (the one slot); job 2 generates and waits for the slot with its frames;
    # job 3 must not start, or a third set of frames would be held.
    await _until_step(runner, jobs[1], 1)
    await asyncio.sleep(0.5)  # time enough for a wrongly started third generation to show
    assert jobs[2].status is JobStatus.QUEUED and runner.stats().num_waiting == 1
    encoder.go.release(3)
    for job in jobs:
        assert (await _finished(runner, job)).status is JobStatus.COMPLETED


@pytest.mark.parametrize("encoder", [HeldEncoder(fail=True)])
async def test_an_encoder_error_fails_the_job_not_the_worker(runner: VideoRunner,
                                                             encoder: HeldEncoder) -> None:
    job = runner.submit(_request())
    encoder.go.release(1)
    await _finished(runner, job)
    assert job.status is JobStatus.FAILED and job.video is None
    assert job.error == ("the MP4 encoding failed (libx264: RuntimeError: the encoder broke)")
    assert _stored(runner) == []
    encoder.fail = False  # the worker goes on taking and finishing jobs
    after = runner.submit(_request(seed=3))
    encoder.go.release(1)
    assert (await _finished(runner, after)).status is JobStatus.COMPLETED


async def test_a_cancel_while_the_mp4_encodes_is_too_late(runner: VideoRunner,
                                                           encoder: HeldEncoder) -> None:
    job = runner.submit(_request())
    await _encode_started(encoder)
    runner.cancel(job.job_id)
    assert job.status is JobStatus.IN_PROGRESS
    encoder.go.release(1)
    await _finished(runner, job)
    assert job.status is JobStatus.COMPLETED and job.error == ""
    assert job.video is not None and _stored(runner) == [job.video.name]


async def test_a_job_cancelled_while_it_denoises_never_encodes(runner: VideoRunner,
                                                               encoder: HeldEncoder) -> None:
    runner.pause_steps()  # the first step's hook holds the loop until the cancel comes
    job = runner.submit(_request(steps=3))
    while job.status is not JobStatus.IN_PROGRESS:
        updated = job.updated
        await updated.wait()
    runner.cancel(job.job_id)
    await _finished(runner, job)
    runner.resume_steps()
    assert job.status is JobStatus.CANCELLED and job.step == 0 and encoder.dtypes == []
    assert not runner.progress().has_work


async def test_drain_waits_for_the_encode(runner: VideoRunner, encoder: HeldEncoder) -> None:
    job = runner.submit(_request())
    await _encode_started(encoder)
    # The grace period ends while the MP4 encodes: the drain's cancel is too late for the job,
    # and the drain waits for its encode.
    drain = asyncio.ensure_future(runner.drain(timeout_s=0.1))
    await asyncio.sleep(0.3)
    assert not drain.done() and runner.progress().has_work
    encoder.go.release(1)
    await drain
    assert job.status is JobStatus.COMPLETED and job.video is not None


def test_the_encoder_is_picked_by_probing() -> None:
    missing = mp4.H264Encoder("h264_no_such_codec")
    assert not mp4.is_usable(missing)
    assert mp4.pick_encoder((missing, mp4.X264)) == mp4.X264
    assert mp4.is_usable(mp4.X264)
    # This test machine has no NVIDIA GPU: NVENC, if PyAV's FFmpeg has it, fails to open.
    assert mp4.pick_encoder() == mp4.X264
