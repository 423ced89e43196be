"""The frontend's gRPC side of the video stage: Video calls to the workers (one channel per
worker), and which addresses are video workers (the router's video pools), so that a job id
naming any other address is refused before anything connects to it."""
from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import grpc
from opentelemetry.trace import SpanKind

from tandem.errors import FailedPrecondition, InvalidRequest, TandemError
from tandem.routing.snapshot import PoolSnapshot
from tandem.runtime import status, tracing
from tandem.runtime import video_convert as convert
from tandem.runtime.interceptor import REQUEST_ID_KEY
from tandem.runtime.tls import TlsConfig, aio_channel
from tandem.v1 import video_pb2 as pb
from tandem.v1 import video_pb2_grpc
from tandem.video.events import Accepted, Finished, Step, VideoEvent
from tandem.video.jobs import JobInfo
from tandem.video.params import VideoRequestParams

#: Public field names a worker's INVALID_ARGUMENT message starts with (tandem.video.params).
_FIELD = re.compile(r"^(prompt|negative_prompt|size|num_frames|seconds|fps|num_inference_steps|"
                    r"guidance_scale|seed|input_reference|model|video_id)\b")
#: How long the list of video workers is trusted before the router is asked again, seconds.
MEMBERS_TTL_S = 2.0




def _error(exc: grpc.aio.AioRpcError, address: str) -> TandemError:
    err = status.from_rpc_error(exc, f"video worker {address}")
    if isinstance(err, (InvalidRequest, FailedPrecondition)) and err.param is None:
        match = _FIELD.match(err.message)
        err.param = match.group(1) if match else None
    return err


class VideoWorkerClients:
    """`list_workers` gives the routers' pools (RouterClient.list_workers: any replica that
    answers, else the last list)."""

    def __init__(self, list_workers: Callable[..., Awaitable[list[PoolSnapshot]]],
                 tls: TlsConfig | None = None) -> None:
        self.tls = tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, video_pb2_grpc.VideoStub]] = {}
        self._list_workers = list_workers
        self._members: frozenset[str] = frozenset()
        self._members_at = 0.0

    def _stub(self, address: str) -> video_pb2_grpc.VideoStub:
        if address not in self._stubs:
            channel = aio_channel(address, self.tls)
            self._stubs[address] = (channel, video_pb2_grpc.VideoStub(channel))
        return self._stubs[address][1]

    async def is_video_worker(self, address: str) -> bool:
        """Whether the router lists `address` in a video pool (asked again after a miss)."""
        fresh = time.monotonic() - self._members_at < MEMBERS_TTL_S
        if address in self._members and fresh:
            return True
        if not fresh or address not in self._members:
            pools = await self._list_workers(timeout_s=5.0)
            self._members = frozenset(w.address for p in pools if p.kind == "video"
                                      for w in p.workers)
            self._members_at = time.monotonic()
        return address in self._members

    async def generate(self, address: str, request_id: str, model: str,
                       params: VideoRequestParams, keep_file: bool, detach: bool
                       ) -> AsyncGenerator[VideoEvent, None]:
        """The job's events: Accepted, Steps, then Finished (or a typed error)."""
        request = pb.GenerateVideoRequest(
            request_id=request_id, model=model, params=convert.params_to_pb(params),
            output=pb.VIDEO_OUTPUT_FILE if keep_file else pb.VIDEO_OUTPUT_BYTES, detach=detach)
        with tracing.span("tandem.v1.Video/Generate", SpanKind.CLIENT, {
                "rpc.system": "grpc", "rpc.service": "tandem.v1.Video", "rpc.method": "Generate",
                "server.address": address}, current=False) as span:
            call = self._stub(address).Generate(request, metadata=(
                (REQUEST_ID_KEY, request_id), *tracing.inject(span)))
            try:
                async for msg in call:
                    event = msg.WhichOneof("event")
                    if event == "accepted":
                        yield Accepted(convert.job_from_pb(msg.accepted))
                    elif event == "progress":
                        yield Step(msg.progress.step, msg.progress.num_steps)
                    elif event == "result":
                        yield Finished(convert.job_from_pb(msg.result.job), msg.result.data)
            except grpc.aio.AioRpcError as exc:
                raise _error(exc, address) from None
            finally:
                call.cancel()

    async def get_job(self, address: str, job_id: str) -> JobInfo:
        try:
            return convert.job_from_pb(await self._stub(address).GetJob(
                pb.VideoJobRef(job_id=job_id), timeout=10.0))
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, address) from None

    async def cancel_job(self, address: str, job_id: str) -> JobInfo:
        try:
            return convert.job_from_pb(await self._stub(address).CancelJob(
                pb.VideoJobRef(job_id=job_id), timeout=10.0))
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, address) from None

    async def read_video(self, address: str, job_id: str
                         ) -> AsyncGenerator[tuple[bytes, int], None]:
        """(chunk, total bytes) in order."""
        call = self._stub(address).ReadVideo(pb.VideoJobRef(job_id=job_id))
        try:
            async for chunk in call:
                yield chunk.data, chunk.total_bytes
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, address) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
