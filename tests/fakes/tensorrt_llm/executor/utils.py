"""Fake of tensorrt_llm/executor/utils.py: only RequestError (a per-request failure)."""
from __future__ import annotations


class RequestError(RuntimeError):
    """Raised while iterating a request's result when that request failed in the executor."""
