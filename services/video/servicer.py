"""Video servicer: protobuf in, runner call, protobuf out."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from tandem.errors import Cancelled, ModelNotFound, UpstreamError
from tandem.runtime import video_convert as convert
from tandem.v1 import video_pb2 as pb
from tandem.v1 import video_pb2_grpc
from tandem.video.jobs import Job, JobStatus
from tandem.video.runner import VideoRunner
from tandem.video.storage import MediaStore


class VideoServicer(video_pb2_grpc.VideoServicer):
    def __init__(self, runner: VideoRunner, store: MediaStore) -> None:
        self.runner = runner
        self.store = store

    def _job(self, job: Job) -> pb.VideoJob:
        return convert.job_to_pb(job.info(self.runner.queue_position(job)))

    async def Generate(self, request: pb.GenerateVideoRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateVideoResponse]:
        model = self.runner.config.model
        if request.model and request.model != model:
            raise ModelNotFound(f"this video worker serves '{model}', not '{request.model}'",
                                param="model")
        job = self.runner.submit(convert.params_from_pb(request.params),
                                 keep_file=request.output != pb.VIDEO_OUTPUT_BYTES)
        try:
            yield pb.GenerateVideoResponse(accepted=self._job(job))
            async for step in self.runner.follow(job):
                yield pb.GenerateVideoResponse(progress=pb.StepProgress(
                    step=step, num_steps=job.num_steps))
            if job.status is JobStatus.CANCELLED:
                raise Cancelled(f"video job {job.job_id} was cancelled: {job.error}")
            if job.status is JobStatus.FAILED:
                raise UpstreamError(f"video job {job.job_id} failed: {job.error}")
            data, job.data = job.data, b""  # handed over once, not kept
            yield pb.GenerateVideoResponse(result=pb.VideoResult(job=self._job(job), data=data))
        finally:
            if not request.detach and not job.is_finished:
                self.runner.cancel(job.job_id, "the caller went away")

    async def GetJob(self, request: pb.VideoJobRef,
                     context: grpc.aio.ServicerContext) -> pb.VideoJob:
        return self._job(self.runner.jobs.get(request.job_id))

    async def CancelJob(self, request: pb.VideoJobRef,
                        context: grpc.aio.ServicerContext) -> pb.VideoJob:
        return self._job(self.runner.cancel(request.job_id))

    async def ReadVideo(self, request: pb.VideoJobRef,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.VideoChunk]:
        video = self.runner.video_of(request.job_id)
        for chunk in self.store.read(video.name):
            yield pb.VideoChunk(data=chunk, total_bytes=video.num_bytes)
