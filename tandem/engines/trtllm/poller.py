"""Polling TensorRT-LLM's KV event and stats queues.

TensorRT-LLM offers no push: `get_kv_cache_events_async(timeout)` and `get_stats_async(timeout)`
return an IterationResult to iterate (tensorrt_llm/executor/result.py). With a timeout > 0 an
empty wait ends the iteration *and marks the result done until the next request is submitted*,
so a quiet engine's later events would wait for new traffic; with timeout 0 an empty queue
raises asyncio.QueueEmpty instead and nothing is marked (AsyncQueue.get in
tensorrt_llm/llmapi/utils.py). So, like Dynamo's publisher, poll with timeout 0 and back off
between empty polls. The queues only exist once a request was submitted: start polling then.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

#: Back-off between empty polls (Dynamo: 5-20 ms for events, 10-100 ms for stats).
MIN_SLEEP_S = 0.005
MAX_SLEEP_S = 0.05
BACKOFF = 1.5


async def poll_forever(fetch: Callable[[float], AsyncIterable[Mapping[str, Any]]],
                       handle: Callable[[Mapping[str, Any]], None],
                       flush: Callable[[], None], name: str) -> None:
    """Drains `fetch(0)` into `handle`, calls `flush` after each non-empty drain, sleeps with
    back-off while the queue is empty. Runs until cancelled; a failing poll is logged and
    retried (a publisher that dies silently would leave the router blind)."""
    sleep_s = MIN_SLEEP_S
    while True:
        got = False
        try:
            async for item in fetch(0.0):
                got = True
                handle(item)
        except (asyncio.QueueEmpty, asyncio.TimeoutError):
            pass
        except Exception:  # keep polling: the next poll may succeed
            log.warning("TensorRT-LLM %s poll failed", name, exc_info=True)
        if got:
            flush()
            sleep_s = MIN_SLEEP_S
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(sleep_s)
            sleep_s = min(MAX_SLEEP_S, sleep_s * BACKOFF)
