"""Both log formats: one line per event for a person, one JSON object per line for collectors,
auto-picked by whether the log stream is a terminal."""
from __future__ import annotations

import io
import json
import logging
import os

import pytest

from tandem.errors import InvalidRequest
from tandem.runtime import logs


def _record(msg: str = "worker candidacy changed", level: int = logging.INFO,
            **extra: object) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "tandem.test", "levelno": level,
                                    "levelname": logging.getLevelName(level), "msg": msg})
    record.__dict__.update(extra)
    return record


def test_text_is_one_line_with_time_level_service_message_and_fields() -> None:
    token = logs.request_id_var.set("req-7")
    try:
        line = logs.TextFormatter("router").format(_record(
            worker="127.0.0.1:9200", healthy=True,
            error="UNAVAILABLE: failed to connect\n  debug_error_string = {...}",
            config={"port": 9100}))
    finally:
        logs.request_id_var.reset(token)
    assert "\n" not in line
    clock, level, service, rest = line.split(maxsplit=3)
    assert len(clock) == len("12:01:02.345") and clock[2] == clock[5] == ":"
    assert (level, service) == ("INFO", "router")
    assert rest.startswith("worker candidacy changed  request_id=req-7 worker=127.0.0.1:9200 "
                           "healthy=True ")
    assert 'error="UNAVAILABLE: failed to connect debug_error_string = {...}"' in rest
    assert rest.endswith('config={"port":9100}')


def test_text_puts_a_traceback_under_its_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        record = _record("step failed", logging.ERROR, exc_info=sys.exc_info())
    first, *rest = logs.TextFormatter("decode").format(record).splitlines()
    assert "ERROR decode       step failed" in first
    assert rest and all(line.startswith("    ") for line in rest)
    assert rest[-1].strip() == "ValueError: boom"


def test_json_is_one_object_per_line_with_the_same_fields() -> None:
    line = logs.JsonFormatter("router").format(_record(worker="w1", healthy=False))
    entry = json.loads(line)
    assert entry["service"] == "router" and entry["level"] == "info"
    assert entry["msg"] == "worker candidacy changed"
    assert entry["worker"] == "w1" and entry["healthy"] is False
    assert isinstance(entry["ts"], float)


def test_auto_is_text_on_a_terminal_and_json_elsewhere() -> None:
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            assert logs.resolve_format("auto", terminal) == "text"
    finally:
        os.close(leader)
        os.close(follower)
    assert logs.resolve_format("auto", io.StringIO()) == "json"
    assert logs.resolve_format("json", io.StringIO()) == "json"
    assert logs.resolve_format("text", io.StringIO()) == "text"
    with pytest.raises(InvalidRequest, match="--log-format"):
        logs.resolve_format("yaml", io.StringIO())


@pytest.mark.parametrize("log_format,level", [("text", logging.DEBUG), ("json", logging.INFO)])
def test_the_start_up_config_is_debug_on_a_console_and_info_for_collectors(
        log_format: str, level: int, caplog: pytest.LogCaptureFixture) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup("frontend", "debug", log_format)
        root.addHandler(caplog.handler)
        logs.log_config(logging.getLogger("tandem.test"), {"port": 1}, stage="decode")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    (record,) = [r for r in caplog.records if r.getMessage() == "config"]
    assert record.levelno == level and record.__dict__["config"] == {"port": 1}
