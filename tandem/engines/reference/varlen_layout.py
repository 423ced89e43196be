"""The layout varlen.flash_prefill attends a step's prompt sequences in, kept on the step's
AttentionMetadata (batch.py) so that every layer shares it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class VarlenPrefill:
    """The step's prompt sequences for flash attention, shared by every layer."""

    #: [Tp] rows of q (the step's tokens) that belong to prompt sequences, in order.
    rows: torch.Tensor
    #: [Tk] flat KV slots of their contexts, sequence after sequence.
    slots: torch.Tensor
    #: [P + 1] int32 cumulative query and context lengths.
    cum_q: torch.Tensor
    cum_k: torch.Tensor
    max_q: int
    max_k: int
    #: Every row of the step is a prompt row (no decode part): `rows` is then unused.
    all_rows: bool
