"""The video stage end to end: `tandem up --video-ports` (a mock-engine text worker beside a
reference video worker on the tiny random-weight Wan, CPU), driven over HTTP. Dynamo's
synchronous form returns an MP4 (url or b64_json) that decodes with PyAV to the requested frame
count and size; OpenAI's job form (also through the official `openai` client) reports progress
that grows and ends completed; DELETE stops a running job within a denoising step and the worker
takes the next job; bad inputs are 400s naming the field (an unknown model: 404, as for chat) and
every service stays up."""
from __future__ import annotations

import base64
import io
import json
import pathlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.topology import Topology, free_ports, start_topology

MODEL = "wan-tiny"
SMALL = {"model": MODEL, "prompt": "a red fox in the snow", "size": "48x32", "num_frames": 9,
         "num_inference_steps": 2, "seed": 7}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    (video_port,) = free_ports(1)
    media = tmp_path_factory.mktemp("media")
    topology = start_topology(
        "--engine", "mock", "--speedup-ratio", "0", "--video-ports", str(video_port),
        "--video-served-model-name", MODEL, "--media-output-dir", str(media),
        # The openai client cannot pass steps in its multipart form: a small default.
        env={"TANDEM_DEFAULT_NUM_INFERENCE_STEPS": "3"})
    yield topology
    assert topology.stop() == 0


def call(topo: Topology, method: str, path: str, body: dict[str, Any] | None = None
         ) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(topo.http_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            raw = reply.read()
            kind = reply.headers.get("Content-Type", "")
            return reply.status, raw if kind == "video/mp4" else json.loads(raw)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def frames_of(mp4: bytes) -> tuple[int, int, int]:
    import av

    with av.open(io.BytesIO(mp4)) as container:
        frames = list(container.decode(video=0))
    return len(frames), frames[0].width, frames[0].height


def wait_finished(topo: Topology, video_id: str) -> tuple[dict[str, Any], list[int]]:
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        code, job = call(topo, "GET", f"/v1/videos/{video_id}")
        assert code == 200, job
        seen.append(job["progress"])
        if job["status"] in ("completed", "failed", "cancelled"):
            return job, seen
        time.sleep(0.02)
    raise AssertionError(f"video {video_id} did not finish: {seen[-5:]}")


def test_models_list_the_video_model_with_its_kind(topo: Topology) -> None:
    code, models = call(topo, "GET", "/v1/models")
    assert code == 200
    assert {"id": MODEL, "kind": "video"}.items() <= next(
        m for m in models["data"] if m["id"] == MODEL).items()


def test_dynamo_form_url_serves_an_mp4_of_the_requested_shape(topo: Topology) -> None:
    code, reply = call(topo, "POST", "/v1/videos", {**SMALL, "response_format": "url"})
    assert code == 200, reply
    assert reply["status"] == "completed" and reply["progress"] == 100
    url = reply["data"][0]["url"]
    assert url.endswith(f"/v1/videos/{reply['id']}/content")
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.headers["Content-Type"] == "video/mp4"
        assert frames_of(response.read()) == (9, 48, 32)


def test_dynamo_form_b64_json(topo: Topology) -> None:
    code, reply = call(topo, "POST", "/v1/videos",
                       {**SMALL, "size": "32x48", "num_frames": 5, "response_format": "b64_json"})
    assert code == 200, reply
    assert frames_of(base64.b64decode(reply["data"][0]["b64_json"])) == (5, 32, 48)


def test_job_progress_grows_and_ends_completed(topo: Topology) -> None:
    code, job = call(topo, "POST", "/v1/videos", {**SMALL, "num_inference_steps": 60})
    assert code == 200 and job["status"] in ("queued", "in_progress"), job
    final, seen = wait_finished(topo, job["id"])
    assert final["status"] == "completed" and final["progress"] == 100
    assert seen == sorted(seen) and len(set(seen)) >= 3, seen
    code, mp4 = call(topo, "GET", f"/v1/videos/{job['id']}/content")
    assert code == 200 and frames_of(mp4) == (9, 48, 32)


def test_cancel_stops_the_worker_within_a_step_and_frees_it(topo: Topology) -> None:
    code, job = call(topo, "POST", "/v1/videos",
                     {**SMALL, "size": "96x96", "num_frames": 17, "num_inference_steps": 100})
    assert code == 200, job
    while (current := call(topo, "GET", f"/v1/videos/{job['id']}")[1])["step"] < 2:
        time.sleep(0.01)
    code, cancelled = call(topo, "DELETE", f"/v1/videos/{job['id']}")
    assert code == 200, cancelled
    final, _ = wait_finished(topo, job["id"])
    assert final["status"] == "cancelled" and final["error"]["code"] == "cancelled"
    assert cancelled["step"] <= final["step"] <= cancelled["step"] + 1 < 100
    code, reply = call(topo, "GET", f"/v1/videos/{job['id']}/content")
    assert code == 400 and reply["error"]["param"] == "video_id"
    code, reply = call(topo, "POST", "/v1/videos", {**SMALL, "response_format": "url"})
    assert code == 200 and reply["status"] == "completed"  # the worker took the next job
    assert current["step"] >= 2


@pytest.mark.parametrize(("change", "status", "param"), [
    ({"size": "40x32"}, 400, "size"),
    ({"num_frames": 8}, 400, "num_frames"),
    ({"num_frames": 1001}, 400, "num_frames"),
    ({"prompt": " "}, 400, "prompt"),
    ({"prompt": None}, 400, "prompt"),
    ({"num_inference_steps": "many"}, 400, "num_inference_steps"),
    ({"quality": "hd"}, 400, "quality"),
    ({"model": "no-such-video-model"}, 404, "model"),
])
def test_bad_inputs_name_the_field(topo: Topology, change: dict[str, Any], status: int,
                                   param: str) -> None:
    body = {k: v for k, v in {**SMALL, **change}.items() if v is not None}
    code, reply = call(topo, "POST", "/v1/videos", body)
    assert (code, reply["error"]["param"]) == (status, param), reply


def test_unknown_and_forged_ids_are_404(topo: Topology) -> None:
    for video_id in ("video_nope", "video_" + "0" * 32 + "gezdgnbvgy3tqojqgewtembrfyyc4mj2gi"):
        code, reply = call(topo, "GET", f"/v1/videos/{video_id}")
        assert code == 404 and reply["error"]["code"] == "video_not_found"


def test_openai_client_job_form(topo: Topology, tmp_path: pathlib.Path) -> None:
    client = openai.OpenAI(api_key="unused", base_url=topo.http_url + "/v1")
    video = client.videos.create(model=MODEL, prompt="waves at dusk", size="32x32", seconds="4")
    assert video.status in ("queued", "in_progress") and video.id.startswith("video_")
    final, _ = wait_finished(topo, video.id)
    assert final["status"] == "completed" and final["num_frames"] == 65
    assert client.videos.retrieve(video.id).status == "completed"
    content = client.videos.download_content(video.id)
    assert frames_of(content.read()) == (65, 32, 32)


def test_services_stay_up(topo: Topology) -> None:
    assert topo.process.poll() is None
    assert call(topo, "GET", "/health")[0] == 200
    code, reply = call(topo, "POST", "/v1/videos", {**SMALL, "response_format": "url"})
    assert code == 200 and reply["status"] == "completed"
