"""What one engine step hands the model: the flattened new tokens of every scheduled sequence
and where their KV lives in the paged cache.

The KV cache is ONE tensor per device (so NIXL can register it as one region):
    kv_cache[layer, 0 = K | 1 = V, block_id, offset_in_block, kv_head, head_dim]
A token at position p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`; its flat slot is `block_id * block_size + offset`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engines.reference.varlen_layout import VarlenPrefill


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole paged KV pool as one contiguous allocation."""
    return torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_size),
                       dtype=dtype, device=device)


@dataclass
class AttentionMetadata:
    """Layout of one forward pass over T new tokens from S sequences.

    Attention contract (per layer): FIRST write the K/V of all T new tokens into the cache at
    `slot_mapping`, THEN compute attention for each sequence's new tokens over its first
    `context_lens[s]` cached positions (causal: a new token at position p sees positions <= p).
    Writing everything first matters: a sequence may reuse prefix blocks another sequence in the
    same step is writing (prefix-cache hits on blocks committed this step).
    """

    #: [T] int64, device: flat KV slot of each new token.
    slot_mapping: torch.Tensor
    #: S + 1 Python ints: sequence s owns new tokens [query_start_loc[s], query_start_loc[s+1]).
    query_start_loc: list[int]
    #: S Python ints: cached tokens of sequence s once this step's tokens are written
    #: (= its position of the last new token + 1).
    context_lens: list[int]
    #: [S] int64, device: context_lens as a tensor (for batched masks).
    context_lens_t: torch.Tensor
    #: [S, max_blocks] int64, device: each sequence's block ids, padded with 0.
    block_tables: torch.Tensor
    block_size: int
    #: Every sequence has exactly one new token (a pure decode step): enables batched attention.
    is_decode_only: bool
    #: In a step that mixes prompt chunks with one-token sequences (decodes), those sequences,
    #: attended in one batch as in a decode step; None otherwise.
    decode_part: DecodePart | None = None
    #: The prompt sequences' flash-attention layout (varlen.build_layout), built by the first
    #: layer that needs it and shared by the others.
    varlen: VarlenPrefill | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass
class DecodePart:
    """The one-token sequences of a mixed step (chunked prefill beside decodes): their rows of
    the step's tokens and their own metadata (`is_decode_only`), so that they take the batched
    decode attention instead of one attention call each."""

    #: [D] int64, device: the row of each such sequence's new token among the step's T tokens.
    rows: torch.Tensor
    #: Their tables and lengths (slot_mapping and query_start_loc unused).
    meta: AttentionMetadata
    #: Their indices among the step's sequences (Python ints): the per-sequence loop skips them.
    seqs: frozenset[int] = field(default_factory=frozenset)
