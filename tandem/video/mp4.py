"""Frames to MP4: H.264 (libx264, yuv420p, the profile every player decodes) through PyAV's
bundled FFmpeg, in memory."""
from __future__ import annotations

import io
from typing import Any

#: x264 constant rate factor: 18 is visually lossless for most content.
CRF = 18


def to_uint8(frames: Any) -> Any:
    """float RGB in [0, 1] -> uint8, rounded (as diffusers' numpy_to_pil)."""
    import numpy as np

    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_mp4(frames: Any, fps: int, crf: int = CRF) -> bytes:
    """Encodes (num_frames, height, width, 3) frames (float in [0, 1] or uint8) as an MP4.

    Height and width must be even (yuv420p halves the chroma planes); Wan's are multiples of 16.
    """
    import av
    import numpy as np

    pixels = frames if frames.dtype == np.uint8 else to_uint8(frames)
    num_frames, height, width, _ = pixels.shape
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf)}
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels[i]), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()
