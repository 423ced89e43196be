"""Chained block hashes: the one hashing scheme every engine and the router use.

A block's hash covers its parent's hash, its token ids and the content hashes of any multimodal
items touching it, so equal hashes mean equal prefixes (up to 64-bit collisions). Hashes are
64-bit unsigned ints from blake2b, identical in every process and on every machine; Python's
`hash()` is never used because it is salted per process.

Byte layout hashed for one block (all little-endian):
    parent:  b"\\x00" when the block is first in its sequence, else b"\\x01" + parent as uint64
    tokens:  uint32 count, then each token id as uint32
    extras:  per item a tag byte, a uint32 length and the item's bytes (str items as UTF-8)
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

_NO_PARENT = b"\x00"
_U32 = struct.Struct("<I")
_PARENT = struct.Struct("<BQ")
_LITTLE = sys.byteorder == "little"

ExtraKey = str | bytes | int


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("I", tokens)  # raises OverflowError on ids outside uint32
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _extra_bytes(item: ExtraKey) -> bytes:
    if isinstance(item, str):
        raw, tag = item.encode(), b"s"
    elif isinstance(item, bytes):
        raw, tag = item, b"b"
    else:
        raw, tag = int(item).to_bytes(8, "little", signed=True), b"i"
    return tag + _U32.pack(len(raw)) + raw


def hash_block(parent: int | None, tokens: Sequence[int], extra: Sequence[ExtraKey] = ()) -> int:
    """The hash of one block given its parent's hash (None for the first block).

    `extra` carries anything else the block's KV depends on, e.g. the content hashes of the
    multimodal items whose placeholder tokens fall into the block, in placeholder order.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(_NO_PARENT if parent is None else _PARENT.pack(1, parent))
    h.update(_U32.pack(len(tokens)))
    h.update(_token_bytes(tokens))
    for item in extra:
        h.update(_extra_bytes(item))
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent_hash: int | None = None,
    mm_hashes_per_block: Sequence[Sequence[ExtraKey]] | None = None,
) -> list[int]:
    """Chained hashes of the FULL blocks of `token_ids`; a trailing partial block gets none.

    Args:
        token_ids: the sequence's tokens from its first block (or from the block after
            `parent_hash`'s block when continuing a chain).
        block_size: tokens per block, > 0.
        parent_hash: the hash of the block preceding `token_ids[0]`, None at a sequence start.
        mm_hashes_per_block: optional, entry i lists the multimodal content hashes of the items
            touching block i; missing entries mean none.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = parent_hash
    num_full = len(token_ids) // block_size
    for i in range(num_full):
        extra: Sequence[ExtraKey] = ()
        if mm_hashes_per_block is not None and i < len(mm_hashes_per_block):
            extra = mm_hashes_per_block[i]
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
