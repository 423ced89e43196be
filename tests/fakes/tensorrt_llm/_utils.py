"""Fake of the KV event serializer in tensorrt_llm/_utils.py (NVIDIA/TensorRT-LLM @ ed53795b).

Upstream serializes the C++ KVCacheEvent bindings; the fake serializes look-alike dataclasses
with the same class names (the serializer dispatches on `type(event.data).__name__`), so the
dicts that reach `get_kv_cache_events_async` have exactly upstream's shape:

    {"event_id": int, "data": {...}, "window_size": int[, "attention_dp_rank": int]}
    data = {"type": "created", "num_blocks_per_cache_level": [...]}
         | {"type": "stored", "parent_hash": int | None, "blocks": [
                {"type": "stored_block", "block_hash": int, "tokens": [
                    {"type": "unique_token", "token_id": int, "token_extra_id": int}, ...],
                 "cache_level": int, "priority": int}, ...]}
         | {"type": "removed", "block_hashes": [int, ...]}
         | {"type": "updated", "block_hash": int,
            "cache_level": {"type": "event_diff", "new_value": int, "old_value": int} | None,
            "priority": {"type": "event_diff", ...} | None}
(`updated`: `_updated_to_json` / `_event_diff_to_json`; a diff the update does not change is
None in the C++ binding, kept as None here.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class UniqueToken:
    token_id: int
    token_extra_id: int = 0


@dataclass
class KVCacheCreatedData:
    num_blocks_per_cache_level: list[int]


@dataclass
class KVCacheStoredBlockData:
    block_hash: int
    tokens: list[UniqueToken]
    cache_level: int = 0
    priority: int = 35


@dataclass
class KVCacheStoredData:
    parent_hash: int | None
    blocks: list[KVCacheStoredBlockData] = field(default_factory=list)


@dataclass
class KVCacheRemovedData:
    block_hashes: list[int]


@dataclass
class KVCacheEventDiff:
    old_value: int
    new_value: int


@dataclass
class KVCacheUpdatedData:
    block_hash: int
    cache_level: KVCacheEventDiff | None = None
    priority: KVCacheEventDiff | None = None


@dataclass
class KVCacheEvent:
    event_id: int
    data: Any
    window_size: int
    attention_dp_rank: int | None = None


class KVCacheEventSerializer:

    @classmethod
    def get_event_serialize_func(cls, event_type: str) -> Any:
        return {
            "KVCacheCreatedData": cls._created_to_json,
            "KVCacheStoredData": cls._stored_to_json,
            "KVCacheStoredBlockData": cls._stored_block_to_json,
            "KVCacheRemovedData": cls._removed_to_json,
            "KVCacheUpdatedData": cls._updated_to_json,
        }.get(event_type, None)

    @classmethod
    def to_json_str(cls, event: KVCacheEvent | None) -> dict[str, Any]:
        if event is None:
            return {}
        event_type = type(event.data).__name__
        func = cls.get_event_serialize_func(event_type)
        if func is None:
            raise ValueError(f"Unknown KVCache event data type: {event_type}")
        out = {"event_id": event.event_id, "data": func(event.data),
               "window_size": event.window_size}
        if event.attention_dp_rank is not None:
            out["attention_dp_rank"] = event.attention_dp_rank
        return out

    @staticmethod
    def _created_to_json(data: KVCacheCreatedData) -> dict[str, Any]:
        return {"type": "created", "num_blocks_per_cache_level": data.num_blocks_per_cache_level}

    @staticmethod
    def _stored_to_json(data: KVCacheStoredData) -> dict[str, Any]:
        return {"type": "stored", "parent_hash": data.parent_hash,
                "blocks": [KVCacheEventSerializer._stored_block_to_json(b) for b in data.blocks]}

    @staticmethod
    def _stored_block_to_json(data: KVCacheStoredBlockData) -> dict[str, Any]:
        return {"type": "stored_block", "block_hash": data.block_hash,
                "tokens": [{"type": "unique_token", "token_id": t.token_id,
                            "token_extra_id": t.token_extra_id} for t in data.tokens],
                "cache_level": data.cache_level, "priority": data.priority}

    @staticmethod
    def _removed_to_json(data: KVCacheRemovedData) -> dict[str, Any]:
        return {"type": "removed", "block_hashes": data.block_hashes}

    @staticmethod
    def _updated_to_json(data: KVCacheUpdatedData) -> dict[str, Any]:
        return {"type": "updated", "block_hash": data.block_hash,
                "cache_level": KVCacheEventSerializer._event_diff_to_json(data.cache_level),
                "priority": KVCacheEventSerializer._event_diff_to_json(data.priority)}

    @staticmethod
    def _event_diff_to_json(data: KVCacheEventDiff | None) -> dict[str, Any] | None:
        if data is None:
            return None
        return {"type": "event_diff", "new_value": data.new_value, "old_value": data.old_value}
