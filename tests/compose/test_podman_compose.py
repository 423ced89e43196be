"""compose.yaml run for real: its `cpu` profile under podman (podman-compose), from the image that
deploy/podman/build.sh makes from a Debian base. Every service's health check passes, the
containerised frontend answers a streamed chat request (official `openai` client), decode scales
to 2 and the router finds the new worker, a decode container killed under load loses no stream
(the frontend migrates them), and `down` stops everything within the grace period.

`make compose-test` builds the image and runs this (TANDEM_COMPOSE_TEST=1); `make test` skips it. The frontend routes in its own process (local routing, the default).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = "tandem-compose-test"
SERVICES = ("router-cpu", "prefill-cpu", "decode-cpu", "frontend-cpu")
URL = "http://127.0.0.1:8000/v1"
#: compose.yaml's stop_grace_period: `down` must be done well within it.
GRACE_S = 45
PODMAN_COMPOSE = pathlib.Path(sys.executable).parent / "podman-compose"


def _why_not() -> str:
    if os.environ.get("TANDEM_COMPOSE_TEST") != "1":
        return "run by `make compose-test` (builds the CPU image first)"
    if shutil.which("podman") is None:
        return "needs podman (deploy/podman/setup.sh installs it)"
    if not PODMAN_COMPOSE.exists():
        return "needs podman-compose in the virtual environment (make install)"
    return ""


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "runs")


def compose(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PODMAN_COMPOSE), "-p", PROJECT, "--profile", "cpu", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def containers() -> dict[str, str]:
    """Container name -> state, for this project's containers."""
    out = podman("ps", "-a", "--filter", f"label=io.podman.compose.project={PROJECT}",
                 "--format", "json").stdout
    return {c["Names"][0]: c["State"] for c in json.loads(out or "[]")}


def remove_all() -> None:
    names = list(containers())
    if names:
        podman("rm", "-f", "-t", "0", *names, timeout=120)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(1)


def healthy(name: str) -> bool:
    """Runs the container's own health check (compose's `healthcheck:`); podman schedules them
    with systemd timers, which a host without systemd lacks, so the test runs them."""
    return podman("healthcheck", "run", name).returncode == 0


def router_status() -> dict[str, object]:
    out = podman("exec", f"{PROJECT}_frontend-cpu_1", "tandem", "status", "--json",
                 "--router-address", "router:9100")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def frontend_decode_candidates() -> float:
    """Decode workers the frontend's local router routes to (its metrics)."""
    with urllib.request.urlopen("http://127.0.0.1:8000/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith("tandem_frontend_local_candidates{") and 'kind="decode"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def decode_workers() -> list[tuple[str, bool]]:
    pools = router_status()["pools"]
    return [(w["worker_id"], w["candidate"]) for p in pools if p["kind"] == "decode"  # type: ignore
            for w in p["workers"]]


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    for port in (8000, 8001):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is taken"
    remove_all()
    up = compose("up", "-d", *SERVICES)
    assert up.returncode == 0, up.stderr[-2000:]
    try:
        for service in SERVICES:
            wait_until(lambda s=service: healthy(f"{PROJECT}_{s}_1"),
                       f"{service} never passed its health check")
        yield
    finally:
        compose("down", "-t", str(GRACE_S), timeout=GRACE_S * 4)
        remove_all()


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url=URL, api_key="unused", max_retries=0, timeout=120)


def test_a_streamed_chat_through_the_containerised_frontend(stack: None) -> None:
    api = client()
    model = api.models.list().data[0].id
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})  # all 16 tokens, whatever the demo model says
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_scaled_decode_is_found_and_a_killed_one_loses_no_stream(stack: None) -> None:
    (original, _), = decode_workers()
    scaled = compose("up", "-d", "--scale", "decode-cpu=2", "decode-cpu")
    assert scaled.returncode == 0, scaled.stderr[-2000:]
    second = f"{PROJECT}_decode-cpu_2"
    wait_until(lambda: healthy(second), "the second decode container never got healthy")
    # The router re-resolves `decode` (dns_refresh_s) and takes the new worker on.
    wait_until(lambda: [c for _, c in decode_workers()] == [True, True],
               "the router never took the second decode worker")
    (added,) = [w for w, _ in decode_workers() if w != original]
    # The frontend routes in its own process: it takes the router's list every few seconds and
    # then follows the new worker's health and event streams.
    wait_until(lambda: frontend_decode_candidates() == 2,
               "the frontend's local router never took the second decode worker", 60)

    api = client()
    model = api.models.list().data[0].id
    results: list[tuple[int, str | None]] = []
    served_by: list[str] = []
    errors: list[BaseException] = []
    started = threading.Barrier(9)

    def one(i: int) -> None:
        try:
            raw = api.completions.with_raw_response.create(
                model=model, prompt=f"Story {i}: once upon a time", max_tokens=120,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True})
            served_by.append(raw.headers["x-tandem-decode-worker"])
            tokens, finish, first = 0, None, True
            for chunk in raw.parse():
                if first:
                    first = False
                    started.wait(60)
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            results.append((tokens, finish))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    started.wait(120)  # every stream is under way, spread over both workers
    assert podman("kill", second).returncode == 0
    for thread in threads:
        thread.join(180)
    assert errors == []
    assert added in served_by, served_by  # some streams were on the killed worker...
    assert results == [(120, "length")] * 8  # ...and finished on the other
    wait_until(lambda: [c for _, c in decode_workers()] in ([True], [True, False]),
               "the router kept the killed worker as a candidate")


def test_down_stops_everything_within_the_grace_period(stack: None) -> None:
    started = time.monotonic()
    down = compose("down", "-t", str(GRACE_S), timeout=GRACE_S * 4)
    took = time.monotonic() - started
    assert down.returncode == 0, down.stderr[-2000:]
    assert all(state != "running" for state in containers().values()), containers()
    assert took < GRACE_S, f"down took {took:.0f} s"
