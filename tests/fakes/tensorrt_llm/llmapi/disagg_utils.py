"""Fake of tensorrt_llm/llmapi/disagg_utils.py: the id space of disaggregated requests.

Upstream: "Local ids [0, MIN_GLOBAL_ID) and global disagg ids [MIN_GLOBAL_ID, 2^63) are
disjoint by construction so they never collide"; a disagg_request_id becomes the underlying
request id of both the context and the generation request.
"""
from __future__ import annotations

MIN_GLOBAL_ID = 1 << 40
MAX_GLOBAL_ID = (1 << 63) - 1
