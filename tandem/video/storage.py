"""The media directory: finished MP4s named by the SHA-256 of their bytes.

Names are checked against one pattern and resolved inside the root, files are opened without
following symlinks, and writes go to a temporary file that is renamed into place, so nothing is
read or written outside the directory and a reader never sees half a file. The same bytes get
the same name: a repeated generation is stored once.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import re
import tempfile
from collections.abc import Iterator

from tandem.errors import InvalidRequest
from tandem.video.jobs import JobNotFound, StoredVideo

NAME_PATTERN = re.compile(r"[0-9a-f]{64}\.mp4")
CHUNK_BYTES = 1024 * 1024


class MediaStore:
    def __init__(self, root: str | pathlib.Path, max_bytes: int) -> None:
        self.root = pathlib.Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def path_of(self, name: str) -> pathlib.Path:
        """The file `name` stands for, inside the root.

        Raises:
            InvalidRequest: `name` is not "<sha256 hex>.mp4" (no separators, no dots to climb).
        """
        if not NAME_PATTERN.fullmatch(name):
            raise InvalidRequest(f"not a media name: {name!r}", param="name")
        path = self.root / name
        if path.parent != self.root:  # unreachable given the pattern; kept as the invariant
            raise InvalidRequest(f"not a media name: {name!r}", param="name")
        return path

    def put(self, data: bytes) -> StoredVideo:
        """Stores `data` under its content hash (once: an existing file is kept).

        Raises:
            InvalidRequest: `data` is larger than the store's limit.
        """
        if len(data) > self.max_bytes:
            raise InvalidRequest(f"the video is {len(data)} bytes, more than this worker keeps "
                                 f"({self.max_bytes}); ask for fewer frames or a smaller size")
        digest = hashlib.sha256(data).hexdigest()
        path = self.path_of(f"{digest}.mp4")
        if not (path.is_file() and not path.is_symlink() and path.stat().st_size == len(data)):
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".partial-", suffix=".mp4")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                os.replace(tmp, path)
            except BaseException:
                pathlib.Path(tmp).unlink(missing_ok=True)
                raise
        return StoredVideo(path.name, len(data), digest)

    def read(self, name: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The file's bytes in chunks.

        Raises:
            JobNotFound: the file is gone (or is a symlink, which the store never writes).
        """
        path = self.path_of(name)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            raise JobNotFound(f"video file {name} is no longer stored",
                              param="video_id") from None
        with os.fdopen(fd, "rb") as f:
            while chunk := f.read(chunk_bytes):
                yield chunk

    def size_of(self, name: str) -> int:
        try:
            return os.stat(self.path_of(name), follow_symlinks=False).st_size
        except OSError:
            raise JobNotFound(f"video file {name} is no longer stored",
                              param="video_id") from None
