"""Background tasks that nobody awaits: the event loop keeps only a weak reference to a task,
so each one is held in a set of its owner's until it ends (and the owner can cancel them all
on close)."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> asyncio.Task[None]:
    """Runs `coro` as a task held in `tasks` until it ends."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
