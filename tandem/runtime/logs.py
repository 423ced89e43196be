"""Structured (JSON lines) logging with the current request id (and trace id, when tracing is on)
attached to every record."""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

from tandem.runtime import tracing

#: The request being served by the current task; set by the interceptor and the frontend.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tandem_request_id", default=None)

_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        trace_id = tracing.trace_id()
        if trace_id is not None:
            entry["trace_id"] = trace_id
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(service: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
