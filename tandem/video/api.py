"""/v1/videos bodies: requests in Dynamo's shape (top-level fields or under `nvext`) and OpenAI's
(JSON or multipart form, `seconds` as a string), responses as OpenAI's video job object and as
Dynamo's NvVideosResponse. Every field that is not honoured is a 400 naming it."""
from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidRequest
from tandem.video.jobs import JobInfo, JobStatus
from tandem.video.params import VideoRequestParams

RESPONSE_FORMATS = ("url", "b64_json")
_INT_FIELDS = ("num_frames", "seconds", "fps", "num_inference_steps", "seed")
_NVEXT_FIELDS = ("fps", "num_frames", "negative_prompt", "num_inference_steps",
                 "guidance_scale", "seed")
#: Accepted and ignored: they change nothing Tandem generates.
_IGNORED = ("user", "output_format")
KNOWN_FIELDS = frozenset({"prompt", "model", "size", "negative_prompt", "guidance_scale",
                          "response_format", "input_reference", "nvext", *_INT_FIELDS,
                          *_IGNORED})
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.S)


@dataclass(frozen=True)
class CreateVideo:
    model: str
    params: VideoRequestParams
    #: Dynamo's synchronous form (wait, answer with data[0].url or b64_json); None: OpenAI's
    #: job form (answer at once with the queued job).
    response_format: str | None


def _int(body: Mapping[str, Any], name: str, *, form: bool) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str) and (form or name == "seconds") and value.strip().isdigit():
        return int(value)  # form fields are text; OpenAI sends seconds as "4"
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer", param=name)
    return value


def _float(body: Mapping[str, Any], name: str, *, form: bool) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str) and form:
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number", param=name)
    return float(value)


def _str(body: Mapping[str, Any], name: str, default: str = "") -> str:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string", param=name)
    return value


def _size(body: Mapping[str, Any]) -> tuple[int | None, int | None]:
    size = _str(body, "size")
    if not size:
        return None, None
    match = _SIZE.fullmatch(size.strip())
    if match is None:
        raise InvalidRequest(f"size must be WIDTHxHEIGHT in pixels (e.g. 832x480), got {size!r}",
                             param="size")
    return int(match[1]), int(match[2])


def _image(body: Mapping[str, Any]) -> bytes:
    value = body.get("input_reference")
    if value is None or value == "":
        return b""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)  # a multipart file part
    match = _DATA_URL.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise InvalidRequest("input_reference must be an image file part or a "
                             "data:image/...;base64 URL", param="input_reference")
    try:
        return base64.b64decode(match[1], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("input_reference is not valid base64",
                             param="input_reference") from None


def _merge_nvext(body: Mapping[str, Any]) -> dict[str, Any]:
    nvext = body.get("nvext")
    if nvext is None:
        return dict(body)
    if not isinstance(nvext, dict):
        raise InvalidRequest("nvext must be an object", param="nvext")
    merged = dict(body)
    for key, value in nvext.items():
        if key not in _NVEXT_FIELDS:
            raise InvalidRequest(f"nvext.{key} is not supported for videos", param=f"nvext.{key}")
        if key in body and body[key] != value:
            raise InvalidRequest(f"{key} is given twice with different values (top level and "
                                 "nvext)", param=key)
        merged[key] = value
    return merged


def parse_create(raw: Mapping[str, Any], *, form: bool = False) -> CreateVideo:
    """A POST /v1/videos body (JSON object, or multipart form fields with `form`).

    Raises:
        InvalidRequest: an unknown field, a value of the wrong type, a malformed size.
    """
    unknown = sorted(set(raw) - KNOWN_FIELDS)
    if unknown:
        raise InvalidRequest(f"unsupported field {unknown[0]!r} for /v1/videos",
                             param=unknown[0])
    body = _merge_nvext(raw)
    if not isinstance(body.get("prompt"), str):
        raise InvalidRequest("prompt is required and must be a string", param="prompt")
    response_format = body.get("response_format")
    if response_format is not None and response_format not in RESPONSE_FORMATS:
        raise InvalidRequest(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}",
                             param="response_format")
    width, height = _size(body)
    ints = {name: _int(body, name, form=form) for name in _INT_FIELDS}
    params = VideoRequestParams(
        prompt=body["prompt"], negative_prompt=_str(body, "negative_prompt"), width=width,
        height=height, guidance_scale=_float(body, "guidance_scale", form=form),
        input_image=_image(body), **ints)
    return CreateVideo(_str(body, "model"), params, response_format)


def progress_percent(info: JobInfo) -> int:
    if info.status is JobStatus.COMPLETED:
        return 100
    return int(100 * info.step / info.num_steps) if info.num_steps else 0


def job_object(public_id: str, info: JobInfo) -> dict[str, Any]:
    """OpenAI's video object, plus the generation parameters as resolved."""
    p = info.params
    error = ({"code": info.status.value, "message": info.error}
             if info.status in (JobStatus.FAILED, JobStatus.CANCELLED) else None)
    seconds = (p.num_frames or 0) / (p.fps or 1)
    return {
        "id": public_id, "object": "video", "model": info.model, "status": info.status.value,
        "progress": progress_percent(info), "created_at": int(info.created_at),
        "completed_at": int(info.finished_at) if info.finished_at else None,
        "expires_at": None, "error": error, "size": f"{p.width}x{p.height}",
        "seconds": f"{seconds:g}", "num_frames": p.num_frames, "fps": p.fps,
        "num_inference_steps": p.num_inference_steps, "guidance_scale": p.guidance_scale,
        "seed": p.seed, "step": info.step, "queue_position": info.queue_position,
        "inference_time_s": round(info.generation_seconds, 3),
    }


def dynamo_response(public_id: str, info: JobInfo, data: dict[str, str]) -> dict[str, Any]:
    """Dynamo's NvVideosResponse for a completed job (data: {"url": ...} or {"b64_json": ...})."""
    return {"id": public_id, "object": "video", "model": info.model, "status": "completed",
            "progress": 100, "created": int(info.created_at or time.time()), "data": [data],
            "inference_time_s": round(info.generation_seconds, 3)}
