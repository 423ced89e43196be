"""The encoder cache: vision-encoder outputs by image content hash, least recently used first
out, bounded in bytes. One per engine; the engine's event loop and its worker threads share it,
so every method takes a lock."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class EncoderCache(Generic[V]):
    """content hash -> value (e.g. an embedding tensor) with its size in bytes.

    A value larger than the whole capacity is not kept; capacity 0 keeps nothing (the cache is
    off, lookups always miss). Hits and misses count every `get`.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> V | None:
        """The value under `key` (now most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.num_hits += 1
            return entry[0]

    def put(self, key: str, value: V, num_bytes: int) -> None:
        """Store `value`, evicting least recently used entries until it fits."""
        if num_bytes > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            while self._entries and self.num_bytes + num_bytes > self.capacity_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self.num_bytes -= size
            self._entries[key] = (value, num_bytes)
            self.num_bytes += num_bytes
