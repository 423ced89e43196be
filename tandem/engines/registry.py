"""Backends are chosen by name from this registry, never by if/else chains."""
from __future__ import annotations

import importlib
from collections.abc import Callable

from tandem.engines.args import EngineArgs
from tandem.engines.base import Engine
from tandem.errors import InvalidRequest

EngineFactory = Callable[[EngineArgs], Engine]

# name -> "module:factory"; imported lazily so that a backend's heavy dependencies (torch,
# tensorrt_llm) load only when that backend is used.
_BACKENDS: dict[str, str] = {
    "mock": "tandem.engines.mock.engine:create_mock_engine",
    "reference": "tandem.engines.reference.engine:create_reference_engine",
    # Imports tensorrt_llm only when chosen; without it, creation fails with an install hint.
    "trtllm": "tandem.engines.trtllm.engine:create_trtllm_engine",
}


def register(name: str, target: str) -> None:
    """Adds a backend; `target` is "module:callable" taking EngineArgs and returning an Engine."""
    _BACKENDS[name] = target


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_engine(name: str, args: EngineArgs) -> Engine:
    """Builds the named backend. Raises InvalidRequest listing the supported names."""
    target = _BACKENDS.get(name)
    if target is None:
        raise InvalidRequest(
            f"unknown engine '{name}'; supported: {', '.join(backend_names())}", param="engine")
    module_name, _, attr = target.partition(":")
    factory: EngineFactory = getattr(importlib.import_module(module_name), attr)
    return factory(args)
