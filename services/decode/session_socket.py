"""Decode.Session over this host's Unix-domain socket, as plain frames (tandem.runtime.frames).

Under `tandem up` a decode worker also serves its sessions at `<dir>/<port>.session.sock`, and a
frontend on the same host opens its session to that worker there instead of over gRPC. The
messages are Decode.Session's own (SessionRequest in, SessionBatch out) and the session's
semantics are WorkerSession's; only the transport differs. Why: at one stream every token is one
message, and a gRPC message costs each side a hand-off between gRPC's threads and the event
loop (~0.2-0.3 ms of CPU per message per side on the 2-core VM, against ~0.1 ms for a frame).

A connection is one session; its end (the frontend closed it or died) ends the session and
aborts its requests, as a cancelled gRPC call does. The socket exists only where the gRPC
server's does (plaintext, a local host, `$TANDEM_UNIX_SOCKET_DIR` set).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

from tandem.runtime import frames
from tandem.v1 import decode_pb2 as pb

log = logging.getLogger(__name__)
OpenSession = Callable[[AsyncIterator[pb.SessionRequest]], AsyncGenerator[pb.SessionBatch, None]]


class SessionSocket:
    def __init__(self, path: str, open_session: OpenSession) -> None:
        self.path = path
        self._open_session = open_session
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket left by a worker that died on this port
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        log.info("serving Decode.Session on a Unix socket", extra={"path": self.path})

    async def close(self) -> None:
        """Stops listening and ends every session (after the drain: what still runs is
        aborted, as the gRPC server's stop cancels its calls)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        gone = False

        async def requests() -> AsyncIterator[pb.SessionRequest]:
            nonlocal gone
            try:
                while (message := await frames.read(reader, pb.SessionRequest)) is not None:
                    yield message
            except ConnectionError as exc:
                log.info("session connection broke", extra={"error": str(exc)})
            # The frontend closed the connection or died: its requests end now.
            gone = True
            task.cancel()

        try:
            async with aclosing(self._open_session(requests())) as batches:
                async for batch in batches:
                    writer.write(frames.encode(batch))
                    await writer.drain()
        except asyncio.CancelledError:
            if not gone:
                raise
        except ConnectionError as exc:
            log.info("session connection broke", extra={"error": str(exc)})
        finally:
            self._connections.discard(task)
            writer.close()
