"""Frames to MP4: H.264 (yuv420p, the profile every player decodes) through PyAV's bundled
FFmpeg, in memory, on the GPU's video encoder (NVENC) where PyAV's FFmpeg has it and the driver
lets it open, else on the CPU (libx264, multi-threaded)."""
from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class H264Encoder:
    """An FFmpeg H.264 encoder and the options it runs with."""

    #: FFmpeg codec name (h264_nvenc, libx264).
    codec: str
    #: The codec's private options (FFmpeg ignores names it does not know: keep them exact).
    options: Mapping[str, str] = field(default_factory=dict)
    #: FFmpeg thread type: FRAME (x264's own frame threads, the most throughput) or SLICE.
    thread_type: str = "FRAME"
    #: Encoder threads; 0: FFmpeg's choice (x264: 1.5 per core).
    num_threads: int = 0


#: CPU encoder. crf 18 (visually lossless for most content) kept from the serial encoder; the
#: preset and threading chosen by measurement (benchmarks/video.py's sweep, 33 frames of 832x480,
#: 16-core H100 host): superfast with x264's frame threads takes 0.11 s against medium with
#: PyAV's slice threads' 0.86 s, for 0.4 dB less PSNR and 7% fewer bytes; veryfast took 0.19 s
#: for 0.01 dB more, ultrafast 0.06 s for 9% more bytes (no CABAC: worse on real content).
X264 = H264Encoder("libx264", {"crf": "18", "preset": "superfast"})
#: GPU encoder: constant quality 19 (NVENC's scale runs a little coarser than x264's crf), the
#: middle preset of p1 (fastest) to p7, high-quality tuning; no bit-rate cap.
NVENC = H264Encoder("h264_nvenc", {"preset": "p4", "tune": "hq", "rc": "vbr", "cq": "19",
                                   "b": "0"}, thread_type="SLICE")
#: In order of preference; the first that opens and encodes a test clip is used.
PREFERENCE: tuple[H264Encoder, ...] = (NVENC, X264)


def to_uint8(frames: Any) -> Any:
    """float RGB in [0, 1] -> uint8, rounded (as diffusers' numpy_to_pil)."""
    import numpy as np

    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_mp4(frames: Any, fps: int, encoder: H264Encoder = X264) -> bytes:
    """Encodes (num_frames, height, width, 3) frames (uint8, or float in [0, 1]) as an MP4.

    Height and width must be even (yuv420p halves the chroma planes); Wan's are multiples of 16.
    PyAV releases the GIL while it converts and encodes, so other Python threads keep running.
    """
    import av
    import numpy as np

    pixels = frames if frames.dtype == np.uint8 else to_uint8(frames)
    num_frames, height, width, _ = pixels.shape
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(encoder.codec, rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.thread_type = encoder.thread_type
        stream.thread_count = encoder.num_threads
        stream.options = dict(encoder.options)
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels[i]), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def is_usable(encoder: H264Encoder) -> bool:
    """Whether PyAV's FFmpeg has the codec and it encodes a small clip here (NVENC needs an
    NVIDIA GPU and the driver's libnvidia-encode, which a container may not mount)."""
    import av
    import numpy as np

    if encoder.codec not in av.codecs_available:
        return False
    try:
        encode_mp4(np.zeros((2, 144, 256, 3), np.uint8), 16, encoder)
    except (av.error.FFmpegError, OSError) as exc:
        log.info("H.264 encoder unusable here", extra={"codec": encoder.codec,
                                                       "reason": str(exc)})
        return False
    return True


def pick_encoder(preference: tuple[H264Encoder, ...] = PREFERENCE) -> H264Encoder:
    """The first usable encoder of `preference`; libx264 (bundled in PyAV's wheels) last."""
    for encoder in preference:
        if is_usable(encoder):
            return encoder
    return X264
