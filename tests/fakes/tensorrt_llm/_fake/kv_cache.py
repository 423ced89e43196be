"""A paged KV block manager with block reuse. Upstream's manager is C++ (not read here); what
the fake does is what its events show to a consumer, as serialized by tensorrt_llm/_utils.py
KVCacheEventSerializer and handled by Dynamo's publisher
(components/src/dynamo/trtllm/publisher.py):

- a `created` event per attention window when the pool is built (the publisher learns the
  global window from them);
- stored blocks come in runs sharing one parent_hash; the full blocks of a prompt are stored
  when its context phase completes, and a finished sequence stores the rest, its partial last
  block included (the publisher drops blocks with fewer than block-size tokens, and later
  their removal, so upstream does announce them);
- a stored block no sequence references is evictable (LRU); evicting it emits `removed`;
- block hashes are u64 (size_t upstream; Dynamo converts them to i64 for its wire) and chain
  through the parent's hash; content that is already stored is not announced twice.
Events are only produced with block reuse on (llm.py: "To enable KV events: set
event_buffer_max_size ... set enable_block_reuse to True").

With a secondary (host) pool (kv_cache_config.host_cache_size, onboard_blocks on) it follows
WindowBlockManager in cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp (NVIDIA/TensorRT-LLM
@ b35ac1b6): `created` reports [primary, secondary] blocks per cache level; a primary block
evicted for reuse is offloaded into a secondary block (the LRU one when none is free, whose
block is then removed) and reported as `updated` with cache_level 0 -> 1 (getFreeBlock /
offloadBlock); a reuse match on a secondary block onboards it into a free primary block,
`updated` 1 -> 0 (onboardBlock). Secondary blocks are never referenced by a sequence.
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from tensorrt_llm._utils import (
    KVCacheCreatedData,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
)

PRIMARY, SECONDARY = 0, 1


class NoFreeBlocks(RuntimeError):
    pass


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8, person=b"trtllm-fake")
    h.update((0 if parent is None else parent).to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(h.digest(), "little")


class Block:
    __slots__ = ("block_id", "tokens", "hash", "ref", "level")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.tokens: list[int] = []
        self.hash: int | None = None
        self.ref = 0
        self.level = PRIMARY


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_reuse: bool,
                 enable_partial_reuse: bool, emit: Callable[[Any], None],
                 num_secondary: int = 0) -> None:
        self.total = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_reuse = enable_reuse
        self.enable_partial_reuse = enable_partial_reuse
        self._emit = emit
        self._free = collections.deque(Block(i) for i in range(num_blocks))
        self._evictable: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self._stored: dict[int, Block] = {}
        self.num_secondary = num_secondary if enable_reuse else 0
        #: Offloaded blocks by hash, least recently offloaded first.
        self._secondary: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self.alloc_total = self.alloc_new = self.reused = self.missed = 0
        self.offloaded = self.onboarded = 0
        if enable_reuse:
            emit(KVCacheCreatedData([num_blocks, self.num_secondary]))

    @property
    def secondary_hashes(self) -> set[int]:
        return set(self._secondary)

    @property
    def num_used(self) -> int:
        """Blocks some sequence (or a KV transfer) still references."""
        return self.total - len(self._free) - len(self._evictable)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self, tokens: Sequence[int], reuse: bool = True) -> list[Block]:
        """Blocks holding `tokens`, reusing stored full blocks of the same prefix."""
        tpb, blocks, parent = self.tokens_per_block, [], None
        reuse = reuse and self.enable_reuse
        start = 0
        while reuse and start + tpb <= len(tokens):
            h = block_hash(parent, tokens[start:start + tpb])
            block = self._stored.get(h)
            if block is None or len(block.tokens) < tpb:
                break
            if block.level == SECONDARY:
                try:
                    self._onboard(block)
                except NoFreeBlocks:
                    break
            elif block.ref == 0:
                self._evictable.pop(h)
            block.ref += 1
            blocks.append(block)
            self.reused += 1
            parent, start = h, start + tpb
        try:
            for i in range(start, len(tokens), tpb):
                block = self._take()
                block.tokens = list(tokens[i:i + tpb])
                blocks.append(block)
                self.missed += 1
        except NoFreeBlocks:
            self.release(blocks, store=False)
            raise
        return blocks

    def append(self, blocks: list[Block], token: int) -> None:
        if not blocks or len(blocks[-1].tokens) == self.tokens_per_block:
            blocks.append(self._take())
        blocks[-1].tokens.append(token)

    def store_full(self, blocks: Sequence[Block]) -> int | None:
        """Stores the unstored full blocks; returns the chain hash of the last full block."""
        parent: int | None = None
        run: list[Block] = []
        run_parent: int | None = None
        for block in blocks:
            if len(block.tokens) < self.tokens_per_block:
                break
            h = block.hash if block.hash is not None else block_hash(parent, block.tokens)
            if self.enable_reuse and block.hash is None and h not in self._stored:
                block.hash = h
                self._stored[h] = block
                if not run:
                    run_parent = parent
                run.append(block)
            else:
                self._announce(run_parent, run)
                run = []
            parent = h
        self._announce(run_parent, run)
        return parent

    def release(self, blocks: Sequence[Block], store: bool = True) -> None:
        if store and self.enable_reuse:
            parent = self.store_full(blocks)
            last = blocks[-1] if blocks else None
            if (self.enable_partial_reuse and last is not None and last.hash is None
                    and 0 < len(last.tokens) < self.tokens_per_block):
                h = block_hash(parent, last.tokens)
                if h not in self._stored:
                    last.hash = h
                    self._stored[h] = last
                    self._announce(parent, [last])
        for block in blocks:
            block.ref -= 1
            if block.ref > 0:
                continue
            if block.hash is not None and self._stored.get(block.hash) is block:
                self._evictable[block.hash] = block
            else:
                self._reset(block)
                self._free.append(block)

    def _onboard(self, block: Block) -> None:
        assert block.hash is not None
        del self._secondary[block.hash]
        try:
            primary = self._take()
        except NoFreeBlocks:
            self._secondary[block.hash] = block
            raise
        block.block_id, block.level = primary.block_id, PRIMARY
        self.onboarded += 1
        self._emit(KVCacheUpdatedData(block.hash, KVCacheEventDiff(SECONDARY, PRIMARY)))

    def _offload(self, block: Block) -> Block:
        """Moves an evictable primary `block` to the secondary pool; returns its primary
        memory as an empty block."""
        assert block.hash is not None
        if len(self._secondary) >= self.num_secondary:
            old_hash, _old = self._secondary.popitem(last=False)
            del self._stored[old_hash]
            self._emit(KVCacheRemovedData([old_hash]))
        primary = Block(block.block_id)
        block.level = SECONDARY
        self._secondary[block.hash] = block
        self.offloaded += 1
        self._emit(KVCacheUpdatedData(block.hash, KVCacheEventDiff(PRIMARY, SECONDARY)))
        return primary

    def _take(self) -> Block:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            h, block = self._evictable.popitem(last=False)
            if self.num_secondary:
                block = self._offload(block)
            else:
                del self._stored[h]
                self._emit(KVCacheRemovedData([h]))
                self._reset(block)
        else:
            raise NoFreeBlocks(f"no free KV blocks (pool of {self.total})")
        block.ref = 1
        self.alloc_total += 1
        self.alloc_new += 1
        return block

    @staticmethod
    def _reset(block: Block) -> None:
        block.tokens, block.hash, block.ref = [], None, 0

    def _announce(self, parent: int | None, run: list[Block]) -> None:
        if run:
            self._emit(KVCacheStoredData(parent, [
                KVCacheStoredBlockData(b.hash or 0, [UniqueToken(t) for t in b.tokens])
                for b in run]))
