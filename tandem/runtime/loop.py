"""Runs a service's main coroutine on the fastest available event loop.

uvloop (when installed) makes aiohttp's transports and asyncio's scheduling markedly cheaper, and
grpc.aio runs on it. TANDEM_EVENT_LOOP=asyncio forces the standard loop (e.g. for A/B runs).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    if os.environ.get("TANDEM_EVENT_LOOP", "uvloop") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)
