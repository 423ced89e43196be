"""The target's auxiliary hidden states for an EAGLE-3 head: the residual stream at a few layers.

EAGLE-3 feeds its head the target's hidden states of three layers (low, middle, high),
concatenated. Layer ids follow vLLM's convention: id j is the residual stream ENTERING layer j
(the output of layer j - 1; 0 is the embedding, num_layers the stream after the last layer,
before the final norm), so EAGLE-3's default (2, L // 2, L - 3) reads the outputs of layers 1,
L // 2 - 1 and L - 4, as TensorRT-LLM's (1, L // 2 - 1, L - 4) says in its own convention.

Every forward path of the model writes them (eager, fused, the decode and prefill CUDA graphs)
into ONE static buffer, so that a captured graph writes them too: row i of the buffer is row i
of the step. Nothing is captured unless a model's `aux` is set (an EAGLE-3 proposer is
configured): the forward then costs nothing more.
"""
from __future__ import annotations

import torch


class AuxStates:
    """Where a model's forward copies the residual stream entering `layers`."""

    def __init__(self, layers: tuple[int, ...], hidden_size: int, max_rows: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layers = layers
        self.hidden_size = hidden_size
        #: Layer id -> its column block (a layer named twice fills both).
        self._slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(layers):
            self._slots.setdefault(layer, []).append(slot)
        #: [max_rows, len(layers) * hidden]: the last step's states, row for row.
        self.buffer = torch.zeros(max_rows, len(layers) * hidden_size, dtype=dtype,
                                  device=device)

    def take(self, layer: int, stream: torch.Tensor) -> None:
        """Copies `stream` [T, hidden], the residual stream entering `layer`, if it is one of
        the captured layers."""
        slots = self._slots.get(layer)
        if slots is None:
            return
        rows = stream.shape[0]
        if rows > self.buffer.shape[0]:
            raise RuntimeError(f"a step of {rows} tokens exceeds the {self.buffer.shape[0]} "
                               "rows of the EAGLE-3 hidden-state buffer")
        h = self.hidden_size
        for slot in slots:
            self.buffer[:rows, slot * h:(slot + 1) * h].copy_(stream)

    def rows(self, num_rows: int) -> torch.Tensor:
        """The last step's states of its first `num_rows` rows (a view: copy it before the
        next step)."""
        return self.buffer[:num_rows]
