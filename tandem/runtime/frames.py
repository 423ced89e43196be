"""Protobuf messages on a plain byte stream: each one a frame, its length (4 bytes, big-endian)
then its serialized bytes. Decode.Session uses it between the processes of one host
(services.decode.session_socket), where gRPC's framing and its threads cost more than the work."""
from __future__ import annotations

import asyncio
import struct
from typing import Protocol, TypeVar

_HEADER = struct.Struct(">I")
#: The largest frame accepted (gRPC's default message limit in Tandem's servers).
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...  # noqa: N802 - protobuf's name


M = TypeVar("M")


class FrameError(ConnectionError):
    """The stream broke inside a frame, or a frame is larger than MAX_FRAME_BYTES."""


def encode(message: Message) -> bytes:
    data = message.SerializeToString()
    return _HEADER.pack(len(data)) + data


async def read(reader: asyncio.StreamReader, parse: type[M]) -> M | None:
    """The next message (`parse.FromString` of the next frame); None at the end of the stream
    between two frames.

    Raises:
        FrameError: the stream ended inside a frame, or the frame is too large.
    """
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("the stream ended inside a frame's length") from None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    try:
        data = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise FrameError("the stream ended inside a frame") from None
    return parse.FromString(data)  # type: ignore[attr-defined,no-any-return]
