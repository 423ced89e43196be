"""Video request parameters, /v1/videos bodies, public ids, the media store and MP4 encoding."""
from __future__ import annotations

import io
import os
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.errors import InvalidRequest, TandemError
from tandem.video import api, job_ids
from tandem.video.jobs import JobNotFound
from tandem.video.mp4 import encode_mp4
from tandem.video.params import PipelineSpec, VideoLimits, VideoRequestParams, resolve
from tandem.video.storage import MediaStore

WAN = PipelineSpec(size_multiple=16, temporal_factor=4)
LIMITS = VideoLimits(default_width=32, default_height=32, max_num_frames=33, max_width=128,
                     max_height=128)


def _param_of(**fields: object) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        resolve(VideoRequestParams(**{"prompt": "a cat", **fields}), LIMITS, WAN)
    return info.value.param


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": "   "}, "prompt"),
    ({"width": 40, "height": 32}, "size"),
    ({"width": 32, "height": 256}, "size"),
    ({"num_frames": 8}, "num_frames"),
    ({"num_frames": 37}, "num_frames"),
    ({"num_frames": 0}, "num_frames"),
    ({"seconds": 10, "fps": 16}, "seconds"),
    ({"fps": 0}, "fps"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"guidance_scale": float("nan")}, "guidance_scale"),
    ({"input_image": b"png"}, "input_reference"),
])
def test_bad_parameters_name_their_field(fields: dict[str, object], param: str) -> None:
    assert _param_of(**fields) == param


def test_defaults_and_seconds_round_to_a_frame_count_the_model_makes() -> None:
    p = resolve(VideoRequestParams("a cat", width=32, height=48, seconds=1, fps=16), LIMITS,
                WAN)
    assert (p.width, p.height, p.num_frames, p.fps) == (32, 48, 17, 16)
    assert 0 <= p.seed < 2**63 and p.num_inference_steps == LIMITS.default_num_inference_steps
    assert resolve(VideoRequestParams("a", width=32, height=32, seed=7), LIMITS, WAN).seed == 7


def test_dynamo_body_with_nvext_and_top_level_fields() -> None:
    req = api.parse_create({"model": "m", "prompt": "p", "size": "832x480", "seconds": 4,
                            "response_format": "b64_json",
                            "nvext": {"fps": 24, "num_inference_steps": 8, "seed": 3}})
    assert req.response_format == "b64_json" and req.model == "m"
    assert (req.params.width, req.params.height, req.params.seconds, req.params.fps,
            req.params.num_inference_steps, req.params.seed) == (832, 480, 4, 24, 8, 3)


def test_openai_form_fields_are_text() -> None:
    req = api.parse_create({"prompt": "p", "seconds": "8", "size": "720x1280",
                            "guidance_scale": "4.5", "input_reference": b"\x89PNG"}, form=True)
    assert req.response_format is None
    assert (req.params.seconds, req.params.guidance_scale, req.params.input_image) == (
        8, 4.5, b"\x89PNG")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "p", "n": 2}, "n"),
    ({"prompt": 3}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "p", "size": "big"}, "size"),
    ({"prompt": "p", "num_frames": 8.5}, "num_frames"),
    ({"prompt": "p", "num_frames": True}, "num_frames"),
    ({"prompt": "p", "response_format": "mp4"}, "response_format"),
    ({"prompt": "p", "nvext": {"boundary_ratio": 0.5}}, "nvext.boundary_ratio"),
    ({"prompt": "p", "fps": 16, "nvext": {"fps": 24}}, "fps"),
    ({"prompt": "p", "input_reference": "http://x/y.png"}, "input_reference"),
])
def test_bad_bodies_name_their_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        api.parse_create(body)
    assert info.value.param == param


def test_public_ids_round_trip_and_refuse_forgeries() -> None:
    public = job_ids.encode("10.0.0.7:9400", "ab" * 16)
    assert job_ids.decode(public) == ("10.0.0.7:9400", "ab" * 16)
    for forged in ("video_" + "ab" * 16, "video_xyz", public + "!", "../etc/passwd",
                   job_ids.encode("host/../x", "ab" * 16)):
        with pytest.raises(JobNotFound):
            job_ids.decode(forged)


def test_media_store_is_content_addressed_and_stays_in_its_root(tmp_path: pathlib.Path) -> None:
    store = MediaStore(tmp_path / "media", max_bytes=100)
    stored = store.put(b"video bytes")
    assert stored == store.put(b"video bytes")  # same bytes, same file
    assert stored.name == f"{stored.sha256}.mp4"
    assert b"".join(store.read(stored.name)) == b"video bytes"
    for name in ("../secret.mp4", "/etc/passwd", f"{stored.sha256}.mp4/..", "a" * 64 + ".txt"):
        with pytest.raises(InvalidRequest):
            list(store.read(name))
    with pytest.raises(InvalidRequest, match="more than"):
        store.put(b"x" * 101)
    assert sorted(p.name for p in (tmp_path / "media").iterdir()) == [stored.name]


def test_media_store_never_follows_a_symlink(tmp_path: pathlib.Path) -> None:
    store = MediaStore(tmp_path / "media", max_bytes=100)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a video")
    name = "0" * 64 + ".mp4"
    os.symlink(secret, store.root / name)
    with pytest.raises(JobNotFound):
        list(store.read(name))


def test_mp4_decodes_to_its_frames() -> None:
    import av

    frames = np.random.default_rng(0).random((9, 32, 48, 3), dtype=np.float32)
    data = encode_mp4(frames, fps=16)
    with av.open(io.BytesIO(data)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert container.streams.video[0].codec_context.name == "h264"
    assert len(decoded) == 9 and decoded[0].shape == (32, 48, 3)


_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
            | st.text(max_size=12) | st.sampled_from(["832x480", "32x32", "0x0", "x", "1e9"]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=10)
_VIDEO_FIELDS = ["model", "prompt", "negative_prompt", "size", "seconds", "fps", "num_frames",
                 "num_inference_steps", "guidance_scale", "seed", "response_format",
                 "input_reference", "nvext", "user", "x"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(body=st.dictionaries(st.sampled_from(_VIDEO_FIELDS), _JSON, max_size=5),
       nvext=st.dictionaries(st.sampled_from(_VIDEO_FIELDS), _JSON, max_size=3))
def test_any_video_body_is_parsed_or_refused_with_a_typed_error(
        body: dict[str, object], nvext: dict[str, object]) -> None:
    """What /v1/videos answers 4xx (a TandemError) or takes; anything else would be a 500."""
    if nvext:
        body = {**body, "nvext": nvext}
    try:
        req = api.parse_create({"prompt": "a cat", **body})
        resolve(req.params, LIMITS, WAN)
    except TandemError as exc:
        assert exc.message
