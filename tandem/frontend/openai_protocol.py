"""The frontend's OpenAI protocol layer: one import point for request parsing
(`openai_request`) and response building (`openai_response`). Pure functions and dataclasses: no
HTTP server, no gRPC, no tokenizer."""
from __future__ import annotations

from tandem.frontend.openai_request import Kind, ParsedRequest, parse_request
from tandem.frontend.openai_response import (
    FINISH_REASONS,
    TokenText,
    chat_chunk,
    chat_chunk_first,
    chat_chunk_last,
    chat_chunk_usage,
    chat_completion,
    chat_logprobs,
    completion_chunk,
    completion_chunk_usage,
    completion_logprobs,
    created_now,
    new_completion_id,
    text_completion,
    usage_body,
)

__all__ = [
    "FINISH_REASONS",
    "Kind",
    "ParsedRequest",
    "TokenText",
    "chat_chunk",
    "chat_chunk_first",
    "chat_chunk_last",
    "chat_chunk_usage",
    "chat_completion",
    "chat_logprobs",
    "completion_chunk",
    "completion_chunk_usage",
    "completion_logprobs",
    "created_now",
    "new_completion_id",
    "parse_request",
    "text_completion",
    "usage_body",
]
