"""A video worker's last stage: a finished generation's frames to a stored (or returned) MP4, on
a thread of its own, so that the GPU starts the next job while this one encodes.

Bounded: the runner takes a slot (`reserve`) before it hands over a generation's frames, and a
slot frees only when that job's MP4 is written, so at most `max_pending` jobs' frames wait or
encode at once; past that the GPU loop waits for the encoder rather than piling frames up in
memory (832x480x33 is 40 MB of uint8).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequest
from tandem.video import mp4
from tandem.video.jobs import Job
from tandem.video.storage import MediaStore

if TYPE_CHECKING:
    import numpy as np

#: (frames, fps, encoder) -> MP4 bytes; `mp4.encode_mp4` outside tests.
Encode = Callable[["np.ndarray", int, mp4.H264Encoder], bytes]


class EncodeFailed(Exception):
    """The encoder raised: the job fails with this stage named; the detail goes to the log."""


class Mp4Writer:
    def __init__(self, store: MediaStore, encoder: mp4.H264Encoder | None = None,
                 max_pending: int = 1, encode: Encode = mp4.encode_mp4) -> None:
        """`encoder` None: the first usable of `mp4.PREFERENCE`, picked by `start`."""
        self.store = store
        self.encoder = encoder
        self._encode = encode
        self._slots = asyncio.Semaphore(max_pending)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video-encode")

    async def start(self) -> mp4.H264Encoder:
        """Picks the encoder (a test clip through each candidate, on the encode thread)."""
        if self.encoder is None:
            loop = asyncio.get_running_loop()
            self.encoder = await loop.run_in_executor(self._executor, mp4.pick_encoder)
        return self.encoder

    async def reserve(self) -> None:
        """Waits for a slot; the next `write` frees it."""
        await self._slots.acquire()

    async def write(self, job: Job, frames: np.ndarray) -> None:
        """Encodes the frames and stores the MP4 (`job.video`) or keeps its bytes (`job.data`).
        Frees the slot `reserve` took, whatever happens. A cancellation no longer stops the job
        here: it lands between denoising steps, and these frames are made.

        Raises:
            EncodeFailed: the encoder raised.
            InvalidRequest: the MP4 is larger than the store takes.
        """
        try:
            loop = asyncio.get_running_loop()
            data = await loop.run_in_executor(self._executor, self._encode_or_fail, frames,
                                              job.params.fps)
            if job.keep_file:
                job.video = await loop.run_in_executor(self._executor, self.store.put, data)
            elif len(data) > self.store.max_bytes:
                raise InvalidRequest(f"the video is {len(data)} bytes, more than this worker "
                                     f"returns ({self.store.max_bytes})")
            else:
                job.data = data
        finally:
            self._slots.release()

    def _encode_or_fail(self, frames: np.ndarray, fps: int) -> bytes:
        assert self.encoder is not None, "start() first"
        try:
            return self._encode(frames, fps, self.encoder)
        except Exception as exc:
            raise EncodeFailed(f"{self.encoder.codec}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
