"""TensorRT-LLM's iteration stats as Tandem's EngineStats.

Input: one dict of `LLM.get_stats_async` (IterationStats as JSON; keys as read by Dynamo's
publisher and engine monitor: numActiveRequests, numQueuedRequests, kvCacheStats.{usedNumBlocks,
maxNumBlocks, cacheHitRate}, inflightBatchingStats.{numPausedRequests, numCtxTokens}).

Stats arrive per engine iteration, and an idle engine runs none: the last report of a busy
period would otherwise say "busy" forever. The adapter's own count of requests in flight is
authoritative for that, so request counts are clamped by it and an engine with nothing in
flight reports no active blocks.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.engines.types import EngineStats


def engine_stats(stat: Mapping[str, Any] | None, num_in_flight: int) -> EngineStats:
    """`stat`: the latest iteration stats (None before the first); `num_in_flight`: requests
    the adapter has submitted and not yet seen finish."""
    if stat is None:
        return EngineStats(num_running=0, num_waiting=num_in_flight, kv_blocks_used=0,
                           kv_blocks_total=0, pending_prefill_tokens=0, active_decode_blocks=0,
                           prefix_cache_hit_rate=0.0)
    kv: Mapping[str, Any] = stat.get("kvCacheStats") or {}
    batching: Mapping[str, Any] = stat.get("inflightBatchingStats") or {}
    running = min(int(stat.get("numActiveRequests", 0)), num_in_flight)
    waiting = int(stat.get("numQueuedRequests", 0)) + int(batching.get("numPausedRequests", 0))
    waiting = min(waiting, num_in_flight - running)
    total = int(kv.get("maxNumBlocks", 0))
    used = int(kv.get("usedNumBlocks", total - int(kv.get("freeNumBlocks", total))))
    if num_in_flight == 0:
        used = 0
    return EngineStats(
        num_running=running,
        num_waiting=waiting,
        kv_blocks_used=used,
        kv_blocks_total=total,
        pending_prefill_tokens=int(batching.get("numCtxTokens", 0)) if num_in_flight else 0,
        active_decode_blocks=used,
        prefix_cache_hit_rate=float(kv.get("cacheHitRate", 0.0)),
    )
