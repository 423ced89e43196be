"""Knobs of the fake (not upstream API). Environment variables set the defaults so that a
worker subprocess can be configured; tests may also assign the attributes directly."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Knobs:
    #: Seconds a generation-only request spends "receiving" KV before its first result.
    transfer_delay_s: float = float(os.environ.get("FAKE_TRTLLM_TRANSFER_DELAY_S", "0"))
    #: Seconds per executor step (0: just yield to the event loop).
    step_s: float = float(os.environ.get("FAKE_TRTLLM_STEP_S", "0"))
    #: KV pool size when kv_cache_config.max_tokens is unset (upstream sizes it from GPU memory).
    num_blocks: int = int(os.environ.get("FAKE_TRTLLM_NUM_BLOCKS", "512"))
    #: Bytes of one KV block, which turn kv_cache_config.host_cache_size into secondary blocks
    #: (upstream derives them from the model's KV layout).
    block_bytes: int = int(os.environ.get("FAKE_TRTLLM_BLOCK_BYTES", "65536"))


knobs = Knobs()
