"""Video contract (video.proto) <-> the video library's dataclasses, both directions."""
from __future__ import annotations

from tandem.v1 import video_pb2 as pb
from tandem.video.jobs import JobInfo, JobStatus, StoredVideo
from tandem.video.params import VideoRequestParams

_STATUS_TO_PB = {
    JobStatus.QUEUED: pb.VIDEO_JOB_STATUS_QUEUED,
    JobStatus.IN_PROGRESS: pb.VIDEO_JOB_STATUS_IN_PROGRESS,
    JobStatus.COMPLETED: pb.VIDEO_JOB_STATUS_COMPLETED,
    JobStatus.FAILED: pb.VIDEO_JOB_STATUS_FAILED,
    JobStatus.CANCELLED: pb.VIDEO_JOB_STATUS_CANCELLED,
}
_STATUS_FROM_PB = {v: k for k, v in _STATUS_TO_PB.items()}
_OPTIONAL = ("width", "height", "num_frames", "seconds", "fps", "num_inference_steps",
             "guidance_scale", "seed")


def params_to_pb(p: VideoRequestParams) -> pb.VideoParams:
    msg = pb.VideoParams(prompt=p.prompt, negative_prompt=p.negative_prompt,
                         input_image=p.input_image)
    for name in _OPTIONAL:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def params_from_pb(msg: pb.VideoParams) -> VideoRequestParams:
    optional = {name: getattr(msg, name) if msg.HasField(name) else None for name in _OPTIONAL}
    return VideoRequestParams(prompt=msg.prompt, negative_prompt=msg.negative_prompt,
                              input_image=msg.input_image, **optional)


def job_to_pb(info: JobInfo) -> pb.VideoJob:
    msg = pb.VideoJob(
        job_id=info.job_id, model=info.model, status=_STATUS_TO_PB[info.status],
        step=info.step, num_steps=info.num_steps, queue_position=info.queue_position,
        created_at_unix_ms=int(info.created_at * 1000),
        finished_at_unix_ms=int(info.finished_at * 1000), error=info.error,
        params=params_to_pb(info.params), generation_seconds=info.generation_seconds)
    if info.video is not None:
        msg.video.CopyFrom(pb.StoredVideo(name=info.video.name, num_bytes=info.video.num_bytes,
                                          sha256=info.video.sha256))
    return msg


def job_from_pb(msg: pb.VideoJob) -> JobInfo:
    video = (StoredVideo(msg.video.name, msg.video.num_bytes, msg.video.sha256)
             if msg.HasField("video") else None)
    return JobInfo(msg.job_id, msg.model,
                   _STATUS_FROM_PB.get(msg.status, JobStatus.FAILED), msg.step, msg.num_steps,
                   msg.queue_position, msg.created_at_unix_ms / 1000,
                   msg.finished_at_unix_ms / 1000, msg.error, params_from_pb(msg.params), video,
                   msg.generation_seconds)
