"""Decode.Session as plain frames on a Unix socket: a mock-engine decode servicer behind a
SessionSocket, the frontend's SessionChannel over a SocketCall, in one process."""
from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.decode.servicer import DecodeServicer
from services.decode.session_socket import SessionSocket
from tandem.engines.args import EngineArgs
from tandem.engines.mock.engine import MockEngine, create_mock_engine
from tandem.engines.types import FinishReason
from tandem.errors import Unavailable
from tandem.runtime import frames
from tandem.runtime.clients import _chunk_from_pb
from tandem.runtime.decode_session import SessionChannel, SocketCall
from tandem.runtime.draining import Draining
from tandem.v1 import common_pb2, decode_pb2

Serve = Callable[[float], Awaitable[tuple[MockEngine, SessionSocket]]]


@pytest.fixture
async def serve(tiny_model: str, tmp_path: pathlib.Path) -> AsyncIterator[Serve]:
    started: list[tuple[MockEngine, SessionSocket]] = []

    async def start(speedup_ratio: float) -> tuple[MockEngine, SessionSocket]:
        engine = create_mock_engine(EngineArgs(model=tiny_model, speedup_ratio=speedup_ratio))
        await engine.start()
        sessions = SessionSocket(str(tmp_path / "9200.session.sock"),
                                 DecodeServicer(engine, Draining()).session)
        await sessions.start()
        started.append((engine, sessions))
        return engine, sessions

    yield start
    for engine, sessions in started:
        await sessions.close()
        await engine.close()


def request(request_id: str, max_tokens: int) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=request_id, token_ids=[5, 6, 7, 8],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def channel(sessions: SessionSocket) -> SessionChannel:
    return SessionChannel(SocketCall(sessions.path, "127.0.0.1:9200"), "127.0.0.1:9200")


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_requests_stream_their_tokens_and_usage(serve: Serve) -> None:
    _, sessions = await serve(0)
    session = channel(sessions)
    try:
        async def tokens(request_id: str, n: int) -> tuple[list[int], FinishReason | None]:
            ids: list[int] = []
            async for chunk in session.generate(request(request_id, n), {}, None,
                                                _chunk_from_pb):
                ids += chunk.token_ids
                if chunk.finish_reason is not None:
                    assert chunk.usage is not None and chunk.usage.completion_tokens == n
                    return ids, chunk.finish_reason
            return ids, None

        (a, finish_a), (b, finish_b) = await asyncio.gather(tokens("a", 20), tokens("b", 7))
        assert (len(a), finish_a, len(b), finish_b) == (20, FinishReason.LENGTH, 7,
                                                        FinishReason.LENGTH)
    finally:
        await session.close()


async def test_closing_the_connection_aborts_its_requests(serve: Serve) -> None:
    engine, sessions = await serve(0.5)
    session = channel(sessions)
    chunks = session.generate(request("long", 1000), {}, None, _chunk_from_pb)
    await anext(chunks)
    assert engine.stats().num_running == 1
    await chunks.aclose()  # the cancel goes out on the connection; then the connection goes
    await session.close()
    await until(lambda: engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0)


async def test_a_frontend_that_leaves_without_a_cancel_frees_its_requests(serve: Serve) -> None:
    engine, sessions = await serve(0.5)
    reader, writer = await asyncio.open_unix_connection(sessions.path)
    writer.write(frames.encode(decode_pb2.SessionRequest(generate=request("long", 1000))))
    batch = await frames.read(reader, decode_pb2.SessionBatch)
    assert batch is not None and batch.chunks[0].request_id == "long"
    writer.close()
    await until(lambda: engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0)


async def test_the_worker_closing_fails_what_runs_as_unavailable(serve: Serve) -> None:
    _, sessions = await serve(0.5)
    session = channel(sessions)
    chunks = session.generate(request("long", 1000), {}, None, _chunk_from_pb)
    await anext(chunks)
    await sessions.close()
    with pytest.raises(Unavailable):
        async for _ in chunks:
            pass
    assert session.closed
    assert not pathlib.Path(sessions.path).exists()


async def test_no_listener_is_unavailable(tmp_path: pathlib.Path) -> None:
    session = SessionChannel(SocketCall(str(tmp_path / "none.session.sock"), "127.0.0.1:1"),
                             "127.0.0.1:1")
    with pytest.raises(Unavailable, match="unreachable"):
        async for _ in session.generate(request("a", 4), {}, None, _chunk_from_pb):
            pass


async def test_frames_end_cleanly_only_between_frames() -> None:
    message = decode_pb2.SessionRequest(cancel_request_id="x")
    encoded = frames.encode(message)
    for data, expected in ((encoded, message), (b"", None)):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        assert await frames.read(reader, decode_pb2.SessionRequest) == expected
    for data in (encoded[:2], encoded[:-1],
                 (frames.MAX_FRAME_BYTES + 1).to_bytes(4, "big")):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        with pytest.raises(frames.FrameError):
            await frames.read(reader, decode_pb2.SessionRequest)
