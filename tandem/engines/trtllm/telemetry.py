"""What a trtllm worker reports besides tokens: KV events and load, polled from TensorRT-LLM
(poller.py), translated (events.py, stats.py) and handed to the engine's event sink."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem.engines.trtllm.events import KvEventTranslator
from tandem.engines.trtllm.poller import poll_forever
from tandem.engines.trtllm.stats import engine_stats
from tandem.engines.types import EngineStats, KvEvent


class Telemetry:
    def __init__(self, block_size: int, publish: Callable[[Sequence[KvEvent]], None]) -> None:
        self.translator = KvEventTranslator(block_size)
        self._publish = publish
        self._pending: list[KvEvent] = []
        self._last_stat: Mapping[str, Any] | None = None
        self._pollers: list[asyncio.Task[None]] = []

    def start(self, llm: Any, events_on: bool) -> None:
        """Starts polling once: upstream creates the stats and event queues with the first
        submitted request, so call this after submitting one."""
        if self._pollers:
            return
        loop = asyncio.get_running_loop()
        self._pollers.append(loop.create_task(poll_forever(
            llm.get_stats_async, self._on_stat, lambda: None, "stats")))
        if events_on:
            self._pollers.append(loop.create_task(poll_forever(
                llm.get_kv_cache_events_async, self._on_event, self._flush, "KV event")))

    def stats(self, num_in_flight: int) -> EngineStats:
        return engine_stats(self._last_stat, num_in_flight)

    async def close(self) -> None:
        for task in self._pollers:
            task.cancel()
        await asyncio.gather(*self._pollers, return_exceptions=True)
        self._pollers.clear()

    def _on_stat(self, stat: Mapping[str, Any]) -> None:
        self._last_stat = stat

    def _on_event(self, event: Mapping[str, Any]) -> None:
        self._pending.extend(self.translator.translate(event))

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        self._publish(events)
