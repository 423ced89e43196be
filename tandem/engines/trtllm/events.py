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
- tiers: with `kv_cache_config.host_cache_size` TensorRT-LLM keeps a secondary (host) block
  pool. A stored block's `cache_level` says where it lives (0 primary = device, 1 secondary =
  host); moving a block between levels is an `updated` event with `cache_level` {old_value,
  new_value}: the WindowBlockManager's offloadBlock (0 -> 1, a primary block evicted into a
  free secondary one) and onboardBlock (1 -> 0, a prefix hit on a secondary block)
  (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp); a later `removed` drops the block from
  whichever level holds it. Tandem's events name tiers instead: a level change becomes a
  removal from the old tier and a store into the new one. `updated` events that change only
  the priority carry nothing the router uses.

Unlike Dynamo (which sends token ids and lets its router hash them), Tandem's router matches
the block hashes of tandem.kv.hashing: each stored block is re-hashed with Tandem's chained
hash of its tokens, and TensorRT-LLM's hash is kept only to translate parents and removals.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.engines.types import BlockRemoved, BlockStored, KvEvent, KvTier
from tandem.kv.hashing import hash_block

log = logging.getLogger(__name__)

U64 = (1 << 64) - 1


def as_u64(value: int) -> int:
    return int(value) & U64


def tier_of(cache_level: Any) -> KvTier:
    """TensorRT-LLM's cache level (kPrimaryLevel 0, kSecondaryLevel 1) as a Tandem tier."""
    return KvTier.HOST if cache_level else KvTier.DEVICE


@dataclass(slots=True)
class _Known:
    """A stored full block, as Tandem announced it."""

    tandem_hash: int
    parent: int | None
    tokens: tuple[int, ...]
    mm_hashes: tuple[str, ...]
    tier: KvTier


class KvEventTranslator:
    """Stateful: it remembers the global window and, per TensorRT-LLM hash, the Tandem block
    it was announced as and the tier holding it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.max_window: int | None = None
        self._initial_created = True
        self._known: dict[int, _Known] = {}

    @property
    def num_blocks(self) -> int:
        """Full blocks currently known to be stored (for tests and debugging)."""
        return len(self._known)

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
        if kind == "updated":
            return self._updated(data)
        return []

    def _stored(self, data: Mapping[str, Any]) -> list[KvEvent]:
        engine_parent = data.get("parent_hash")
        parent: int | None = None
        if engine_parent is not None:
            known = self._known.get(as_u64(engine_parent))
            if known is None:  # e.g. events missed before this worker subscribed
                log.debug("stored KV event whose parent block is unknown; dropped")
                return []
            parent = known.tandem_hash
        out: list[KvEvent] = []
        first_parent = parent
        hashes: list[int] = []
        tokens: list[int] = []
        mm_hashes: list[str] = []
        run_tier: KvTier | None = None
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
            tier = tier_of(block.get("cache_level", 0))
            if run_tier is not None and tier != run_tier:  # one event per tier
                out.append(BlockStored(tuple(hashes), first_parent, tuple(tokens),
                                       self.block_size, tuple(mm_hashes), run_tier))
                first_parent, hashes, tokens, mm_hashes = parent, [], [], []
            run_tier = tier
            block_parent = parent
            parent = hash_block(parent, block_tokens, block_mm)
            self._known[as_u64(block["block_hash"])] = _Known(
                parent, block_parent, tuple(block_tokens), tuple(block_mm), tier)
            hashes.append(parent)
            tokens.extend(block_tokens)
            mm_hashes.extend(h for h in block_mm if h not in mm_hashes)
        if hashes and run_tier is not None:
            out.append(BlockStored(tuple(hashes), first_parent, tuple(tokens), self.block_size,
                                   tuple(mm_hashes), run_tier))
        return out

    def _removed(self, data: Mapping[str, Any]) -> list[KvEvent]:
        removed: dict[KvTier, list[int]] = {}
        for engine_hash in data["block_hashes"]:
            known = self._known.pop(as_u64(engine_hash), None)
            if known is not None:  # unknown: a partial block (never announced) or missed
                removed.setdefault(known.tier, []).append(known.tandem_hash)
        return [BlockRemoved(tuple(hashes), tier) for tier, hashes in removed.items()]

    def _updated(self, data: Mapping[str, Any]) -> list[KvEvent]:
        diff = data.get("cache_level")
        known = self._known.get(as_u64(data.get("block_hash", 0)))
        if not isinstance(diff, Mapping) or known is None:
            return []  # a priority update, or a block never announced
        tier = tier_of(diff.get("new_value"))
        if tier == known.tier:
            return []
        old, known.tier = known.tier, tier
        return [BlockRemoved((known.tandem_hash,), old),
                BlockStored((known.tandem_hash,), known.parent, known.tokens, self.block_size,
                            known.mm_hashes, tier)]
