"""What a person sees from `tandem up`: one text line per event on a terminal (no JSON, no
start-up noise from the router), JSON lines when the output goes elsewhere, and a worker that
cannot start said in one line that `tandem up` repeats before it exits non-zero."""
from __future__ import annotations

import json
import os
import pathlib
import pty
import re
import select
import signal
import subprocess
import time

from tests.e2e.topology import ROOT, START_TIMEOUT_S, free_ports, tandem_cmd

# `12:01:02.345 INFO  decode:9200 message  key=value ...`
TEXT_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO |WARNI|ERROR|CRITI) \S+ +\S")


def _up_argv(*extra: str, num_decode: int = 2) -> list[str]:
    http, grpc_port, router, *decode = free_ports(3 + num_decode)
    return tandem_cmd("up", "--http-port", str(http), "--grpc-port", str(grpc_port),
                      "--router-port", str(router), "--decode-ports", *map(str, decode),
                      "--grace-period-s", "5", *extra)


def _read_until(fd: int, done: re.Pattern[str], timeout_s: float) -> str:
    """Reads `fd` (a terminal) until its text matches `done` or it closes."""
    text, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done.search(text):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the terminal closed: every writer exited
            break
        if not chunk:
            break
        text += chunk.decode(errors="replace").replace("\r\n", "\n")
    return text


def test_a_terminal_gets_one_text_line_per_event_and_no_start_up_noise() -> None:
    leader, follower = pty.openpty()
    proc = subprocess.Popen(_up_argv(), stdout=follower, stderr=follower, cwd=ROOT,
                            start_new_session=True)
    os.close(follower)
    try:
        console = _read_until(leader, re.compile(r"Press Ctrl-C to stop\."), START_TIMEOUT_S)
        assert "READY " in console, console
        proc.send_signal(signal.SIGINT)
        console += _read_until(leader, re.compile(r"(?!)"), 30)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    logs = [line for line in console.splitlines()
            if line.strip() and not line.startswith(("READY ", "Tandem is up", "  curl",
                                                     "Press Ctrl-C"))]
    assert logs and all(TEXT_LINE.match(line) for line in logs), "\n".join(logs)
    # The router reaching workers that still load is expected: nothing about it at info.
    assert not [line for line in logs if "event stream" in line or "debug_error" in line]
    assert not [line for line in logs if " WARNI " in line or " ERROR " in line], console
    # Two workers, a router, a frontend: a screenful, not dozens of records.
    assert len(logs) <= 24, "\n".join(logs)


def test_a_pipe_gets_json_lines() -> None:
    proc = subprocess.Popen(_up_argv("--engine", "mock", num_decode=1), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("READY ")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    entries = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    services = {entry["service"] for entry in entries}
    assert {"router", "frontend", "decode"} <= services
    assert any(e["msg"] == "config" and e["level"] == "info" for e in entries)  # whole config


def test_a_worker_that_cannot_start_says_why_in_one_line_and_up_repeats_it(
        tmp_path: pathlib.Path) -> None:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    proc = subprocess.run(_up_argv("--model", str(model), "--log-format", "json", num_decode=1),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    last = lines[-1]
    assert re.match(r"tandem up: (decode-0|frontend) did not start: .*config\.json lacks "
                    r"num_attention_heads", last), proc.stderr
    # The service's own line, word for word.
    reason = last.split(" did not start: ", 1)[1]
    assert any(line.endswith(f": error: {reason}") and line.startswith("tandem serve ")
               for line in lines[:-1]), proc.stderr
    assert "Traceback" not in proc.stderr
