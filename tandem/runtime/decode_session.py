"""The frontend's side of Decode.Session: every request to one decode worker over one stream.

A `SessionChannel` holds one bidirectional call to one worker: requests and cancels go out
through a queue (one writer task), batches come in through one reader task that hands each
request's chunk to its `_Receiver`. When the call ends (worker gone, draining, network), every
request still on it fails as Unavailable, which the pipeline treats as a broken stream
(migration) or a refusal (nothing streamed yet); the next request opens a new call.

The call is a gRPC stream (`GrpcCall`), or plain frames on the worker's Unix socket when it has
one on this host (`SocketCall`; services.decode.session_socket says why).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import grpc

from tandem.engines.types import TokenChunk
from tandem.errors import DeadlineExceeded, TandemError, Unavailable
from tandem.runtime import frames, status
from tandem.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)
ChunkFromPb = Callable[[decode_pb2.GenerateChunk], TokenChunk]
#: Told of each batch read: (produced_unix_ns, sent_unix_ns) from the worker, and when it was read.
BatchObserver = Callable[[int, int, int], None]


class _Receiver:
    """One request's chunks as the reader hands them over; the request's consumer awaits."""

    __slots__ = ("chunks", "error", "_waiter")

    def __init__(self) -> None:
        #: (chunk, received_ns or 0), in order.
        self.chunks: collections.deque[tuple[decode_pb2.GenerateChunk, int]] = collections.deque()
        self.error: TandemError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, chunk: decode_pb2.GenerateChunk, received_ns: int) -> None:
        self.chunks.append((chunk, received_ns))
        self._wake()

    def fail(self, error: TandemError) -> None:
        if self.error is None:
            self.error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Returns once a chunk or an error is there."""
        if self.chunks or self.error is not None:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


def _merged(queued: collections.deque[tuple[decode_pb2.GenerateChunk, int]],
            from_pb: ChunkFromPb) -> TokenChunk:
    """Takes every queued chunk of one request and joins them (tokens and logprobs in order; the
    first cached_tokens and read time; the last chunk's finish and usage)."""
    message, received_ns = queued.popleft()
    chunk = from_pb(message)
    chunk.received_ns = received_ns
    while queued:
        message, received_ns = queued.popleft()
        more = from_pb(message)
        chunk.token_ids += more.token_ids
        chunk.logprobs += more.logprobs
        chunk.finish_reason, chunk.usage = more.finish_reason, more.usage
        if chunk.cached_tokens is None:
            chunk.cached_tokens = more.cached_tokens
        chunk.received_ns = chunk.received_ns or received_ns
    return chunk


class SessionCall(Protocol):
    """One Decode.Session call, whatever carries it."""

    async def read(self) -> decode_pb2.SessionBatch | None:
        """The next batch; None once the worker ended the call.

        Raises:
            TandemError: the call broke (the worker's status, or Unavailable).
        """

    async def write(self, message: decode_pb2.SessionRequest) -> None:
        """Raises Unavailable once the call ended."""

    def cancel(self) -> None: ...


class GrpcCall:
    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self._call = decode_pb2_grpc.DecodeStub(channel).Session()
        self._address = address

    async def read(self) -> decode_pb2.SessionBatch | None:
        try:
            batch = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise status.from_rpc_error(exc, f"decode worker {self._address}") from None
        return None if batch is grpc.aio.EOF else batch

    async def write(self, message: decode_pb2.SessionRequest) -> None:
        try:
            await self._call.write(message)
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise Unavailable(f"session to decode worker {self._address} ended") from exc

    def cancel(self) -> None:
        self._call.cancel()


class SocketCall:
    """The session as frames on the worker's Unix socket (services.decode.session_socket)."""

    def __init__(self, path: str, address: str) -> None:
        self._address = address
        self._connecting = asyncio.ensure_future(asyncio.open_unix_connection(path))

    async def _streams(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.shield(self._connecting)
        except OSError as exc:
            raise Unavailable(f"decode worker {self._address} unreachable: {exc}") from None

    async def read(self) -> decode_pb2.SessionBatch | None:
        reader, _ = await self._streams()
        try:
            return await frames.read(reader, decode_pb2.SessionBatch)
        except ConnectionError as exc:
            raise Unavailable(f"session to decode worker {self._address} broke: {exc}") from None

    async def write(self, message: decode_pb2.SessionRequest) -> None:
        _, writer = await self._streams()
        if writer.is_closing():
            raise Unavailable(f"session to decode worker {self._address} ended")
        writer.write(frames.encode(message))
        try:
            await writer.drain()
        except ConnectionError as exc:
            raise Unavailable(f"session to decode worker {self._address} broke: {exc}") from None

    def cancel(self) -> None:
        if not self._connecting.done():
            self._connecting.cancel()
        elif not self._connecting.cancelled() and self._connecting.exception() is None:
            self._connecting.result()[1].close()


class SessionChannel:
    def __init__(self, call: SessionCall, address: str,
                 on_batch: BatchObserver | None = None) -> None:
        self.address = address
        self._on_batch = on_batch
        self._call = call
        self._outbox: asyncio.Queue[decode_pb2.SessionRequest] = asyncio.Queue()
        self._receivers: dict[str, _Receiver] = {}
        self.closed = False
        loop = asyncio.get_running_loop()
        self._tasks = (loop.create_task(self._read()), loop.create_task(self._write()))

    async def generate(self, message: decode_pb2.GenerateRequest, trace_context: dict[str, str],
                       timeout_s: float | None,
                       from_pb: ChunkFromPb) -> AsyncGenerator[TokenChunk, None]:
        """The request's chunks; closing early (or the deadline passing) cancels it."""
        request_id = message.request_id
        if request_id in self._receivers:
            raise Unavailable(f"request {request_id} is already running on {self.address}")
        receiver = self._receivers[request_id] = _Receiver()
        self._outbox.put_nowait(decode_pb2.SessionRequest(generate=message,
                                                          trace_context=trace_context))
        timer = None
        if timeout_s is not None:
            timer = asyncio.get_running_loop().call_later(timeout_s, receiver.fail,
                                                          DeadlineExceeded("deadline exceeded"))
        finished = False
        try:
            while True:
                await receiver.wait()
                if receiver.chunks:
                    # Everything that arrived since the last turn, as one chunk: a consumer that
                    # fell behind catches up with one event, not one per batch it missed.
                    chunk = _merged(receiver.chunks, from_pb)
                    finished = chunk.finish_reason is not None
                    yield chunk
                    if finished:
                        return
                    continue
                if receiver.error is not None:
                    raise receiver.error
        finally:
            if timer is not None:
                timer.cancel()
            if self._receivers.get(request_id) is receiver:
                del self._receivers[request_id]
            # Ended by the worker (an error it sent, or the session's end): nothing to cancel.
            ended_there = (receiver.error is not None
                           and not isinstance(receiver.error, DeadlineExceeded))
            if not finished and not ended_there and not self.closed:
                self._outbox.put_nowait(decode_pb2.SessionRequest(cancel_request_id=request_id))

    async def _read(self) -> None:
        error: TandemError = Unavailable(f"decode worker {self.address} ended the session")
        try:
            while True:
                batch = await self._call.read()
                if batch is None:
                    break
                # One chunk per batch carries the read time: the last hop is sampled per batch.
                received_ns = time.time_ns()
                if batch.produced_unix_ns and self._on_batch is not None:
                    self._on_batch(batch.produced_unix_ns, batch.sent_unix_ns, received_ns)
                for item in batch.chunks:
                    receiver = self._receivers.get(item.request_id)
                    if receiver is None:
                        continue  # cancelled by us while the batch was on its way
                    if item.HasField("error"):
                        receiver.fail(status.error_for(item.error.code, item.error.message,
                                                       f"decode worker {self.address}"))
                    else:
                        receiver.put(item.chunk, received_ns)
                        received_ns = 0
        except TandemError as exc:
            error = exc
            if not isinstance(error, Unavailable):
                # The session itself broke (not one request): retryable on another worker.
                error = Unavailable(f"decode worker {self.address} session failed: {error}")
        except asyncio.CancelledError:
            error = Unavailable(f"session to decode worker {self.address} closed")
            raise
        finally:
            self._end(error)

    async def _write(self) -> None:
        try:
            while True:
                message = await self._outbox.get()
                await self._call.write(message)
        except Unavailable as exc:
            # The call ended; the reader sees why and fails the requests.
            log.debug("session write failed", extra={"worker": self.address, "error": str(exc)})

    def _end(self, error: TandemError) -> None:
        self.closed = True
        self._call.cancel()
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            receiver.fail(error)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def close(self) -> None:
        self._end(Unavailable(f"session to decode worker {self.address} closed"))
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
