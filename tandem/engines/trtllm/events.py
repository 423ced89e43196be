"""TensorRT-LLM's KV cache events in Tandem's vocabulary.

Input: the dicts `LLM.get_kv_cache_events_async` yields, shaped by KVCacheEventSerializer
(tensorrt_llm/_utils.py): {"event_id", "data": {"type": "created" | "stored" | "removed" |
"updated", ...}, "window_size"[, "attention_dp_rank"]}. The rules follow Dynamo's publisher
(components/src/dynamo/trtllm/publisher.py):

- `created` events come first, one per attention window; the largest window is the global
  attention layer's, and events of any other window are dropped (variable sliding window
  models report every window). Events without "window_size" (older versions) are all kept.
- a stored block with fewer than block-size tokens is partial: it and the rest of its event
  are dropped, and so is its later removal.
- hashes are unsigned 64-bit (size_t upstream; some bindings hand them over signed).
- `updated` events (priority/cache level) carry nothing the router uses.

Unlike Dynamo (which sends token ids and lets its router hash them), Tandem's router matches
the block hashes of tandem.kv.hashing: each stored block is re-hashed with Tandem's chained
hash of its tokens, and TensorRT-LLM's hash is kept only to translate parents and removals.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tandem.engines.types import BlockRemoved, BlockStored, KvEvent
from tandem.kv.hashing import hash_block

log = logging.getLogger(__name__)

U64 = (1 << 64) - 1


def as_u64(value: int) -> int:
    return int(value) & U64


class KvEventTranslator:
    """Stateful: it remembers the global window and TensorRT-LLM hash -> Tandem hash."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.max_window: int | None = None
        self._initial_created = True
        self._tandem_hash: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        """Full blocks currently known to be stored (for tests and debugging)."""
        return len(self._tandem_hash)

    def translate(self, event: Mapping[str, Any]) -> list[KvEvent]:
        data = event["data"]
        kind = data["type"]
        if kind == "created":
            if self._initial_created and "window_size" in event:
                window = int(event["window_size"])
                self.max_window = window if self.max_window is None else max(self.max_window,
                                                                            window)
            return []
        self._initial_created = False
        event_window = event.get("window_size")
        if (event_window is not None and self.max_window is not None
                and int(event_window) != self.max_window):
            return []
        if kind == "stored":
            return self._stored(data)
        if kind == "removed":
            return self._removed(data)
        return []

    def _stored(self, data: Mapping[str, Any]) -> list[KvEvent]:
        engine_parent = data.get("parent_hash")
        parent: int | None = None
        if engine_parent is not None:
            parent = self._tandem_hash.get(as_u64(engine_parent))
            if parent is None:  # e.g. events missed before this worker subscribed
                log.debug("stored KV event whose parent block is unknown; dropped")
                return []
        first_parent = parent
        hashes: list[int] = []
        tokens: list[int] = []
        mm_hashes: list[str] = []
        for block in data["blocks"]:
            block_tokens = [int(t["token_id"]) for t in block["tokens"]]
            if len(block_tokens) > self.block_size:
                log.error("TensorRT-LLM stored a block of %d tokens, more than the block size "
                          "%d; event dropped", len(block_tokens), self.block_size)
                return []
            if len(block_tokens) < self.block_size:
                break  # partial: the router indexes full blocks only
            block_mm = [str(k["hash"]) for k in block.get("mm_keys", ())
                        if k.get("type") == "mm_key" and k.get("hash")]
            parent = hash_block(parent, block_tokens, block_mm)
            self._tandem_hash[as_u64(block["block_hash"])] = parent
            hashes.append(parent)
            tokens.extend(block_tokens)
            mm_hashes.extend(h for h in block_mm if h not in mm_hashes)
        if not hashes:
            return []
        return [BlockStored(tuple(hashes), first_parent, tuple(tokens), self.block_size,
                            tuple(mm_hashes))]

    def _removed(self, data: Mapping[str, Any]) -> list[KvEvent]:
        removed = []
        for engine_hash in data["block_hashes"]:
            tandem = self._tandem_hash.pop(as_u64(engine_hash), None)
            if tandem is not None:  # unknown: a partial block (never announced) or missed
                removed.append(tandem)
        return [BlockRemoved(tuple(removed))] if removed else []
