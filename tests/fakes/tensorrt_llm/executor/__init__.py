"""Fake of tensorrt_llm/executor (results only; there is no executor process)."""
from __future__ import annotations

from tensorrt_llm.executor.result import (
    CompletionOutput,
    GenerationResult,
    IterationResult,
    Logprob,
)
from tensorrt_llm.executor.utils import RequestError

__all__ = ["CompletionOutput", "GenerationResult", "IterationResult", "Logprob", "RequestError"]
