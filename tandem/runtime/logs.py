"""Logging for every Tandem process, in one of two formats, with the current request id (and
trace id, when tracing is on) attached to every record.

- `text`, for a person at a terminal: one line per event, `time level service message
  key=value ...`.
- `json`, for log collectors: one JSON object per line with the same fields.

`auto` (the default) picks text when the log stream (stderr) is a terminal and JSON otherwise
(a container, a file, a pipe), so that `tandem up` in a shell reads like a console and the same
services under Compose or Kubernetes write what a collector parses.
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tandem.errors import InvalidRequest
from tandem.runtime import tracing

#: The request being served by the current task; set by the interceptor and the frontend.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tandem_request_id", default=None)

LOG_FORMATS = ("auto", "text", "json")
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's key fields: request and trace ids, then whatever `extra` the caller gave."""
    fields: dict[str, Any] = {}
    request_id = request_id_var.get()
    if request_id is not None:
        fields["request_id"] = request_id
    trace_id = tracing.trace_id()
    if trace_id is not None:
        fields["trace_id"] = trace_id
    fields.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
    return fields


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`12:01:02.345 INFO  router       worker candidacy changed  worker=127.0.0.1:9200 ...`"""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = (f"{clock}.{int(record.msecs):03d} {record.levelname:<5.5} {self.service:<12} "
                f"{record.getMessage()}")
        fields = _fields(record)
        if fields:
            line += "  " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:  # a traceback is for a person too; it follows its line, indented
            line += "\n" + "\n".join("    " + part for part in
                                     self.formatException(record.exc_info).splitlines())
        return line


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        text = " ".join(value.split())  # one line, whatever the value held
        return text if text and " " not in text and "=" not in text else json.dumps(text)
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(value, default=str, separators=(",", ":"))
    return str(value)


def resolve_format(log_format: str, stream: TextIO) -> str:
    """`text` or `json` for `log_format` (auto: text on a terminal)."""
    if log_format not in LOG_FORMATS:
        raise InvalidRequest(f"--log-format must be one of {', '.join(LOG_FORMATS)}, "
                             f"got '{log_format}'", param="log_format")
    if log_format == "auto":
        return "text" if stream.isatty() else "json"
    return log_format


def setup(service: str, level: str = "info", log_format: str = "auto",
          instance: str = "") -> None:
    """Logs of this process go to stderr in `log_format`. `instance` tells apart processes of
    one service on a console (a worker's port: `decode:9200`)."""
    stream = sys.stderr
    formatter: logging.Formatter
    if resolve_format(log_format, stream) == "text":
        formatter = TextFormatter(f"{service}:{instance}" if instance else service)
    else:
        formatter = JsonFormatter(service)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def is_text() -> bool:
    """Whether this process logs for a person (text format)."""
    return any(isinstance(h.formatter, TextFormatter) for h in logging.getLogger().handlers)


def log_config(logger: logging.Logger, config: Mapping[str, Any], **extra: Any) -> None:
    """The whole start-up config: at info in JSON (collectors keep it), at debug in text (a
    screenful of settings on a console hides what matters; --log-level debug shows it)."""
    level = logging.DEBUG if is_text() else logging.INFO
    logger.log(level, "config", extra={"config": dict(config), **extra})
