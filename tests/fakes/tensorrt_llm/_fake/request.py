"""One request inside the fake executor."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from tensorrt_llm._fake.kv_cache import Block
from tensorrt_llm.executor.result import GenerationResult, Logprob, Response
from tensorrt_llm.sampling_params import SamplingParams

QUEUED, TRANSFER, RUNNING, DONE = "queued", "transfer", "running", "done"


@dataclass
class FakeRequest:
    request_id: int
    kind: str  # context_only | generation_only | context_and_generation
    prompt: list[int]
    params: SamplingParams
    result: GenerationResult
    streaming: bool
    disagg: Any = None
    state: str = QUEUED
    tokens: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    model_state: int = 0
    num_generated: int = 0
    decoding_iter: int = 0
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    #: Tokens received with the KV that the next response carries first (generation-only).
    carried: list[int] = field(default_factory=list)
    transfer: asyncio.Task[list[int]] | None = None
    #: With params.guided_decoding on an LLM with a guided decoding backend: its grammar
    #: matcher (tensorrt_llm._fake.guided).
    matcher: Any = None

    @property
    def stop_ids(self) -> set[int]:
        ids = set(self.params.stop_token_ids or ())
        if not self.params.ignore_eos and self.params.end_id is not None:
            ids.add(self.params.end_id)
        return ids

    def finish_reason(self, token: int) -> str | None:
        if token in self.stop_ids and self.num_generated >= (self.params.min_tokens or 0):
            return "stop"
        if self.num_generated >= self.params.max_tokens:
            return "length"
        return None

    def respond(self, finish: str | None = None, ctx_params: dict[str, Any] | None = None,
                error: str | None = None) -> None:
        """Sends the tokens produced since the last response (every step when streaming, once
        at the end otherwise)."""
        if error is None and finish is None and not self.streaming:
            return
        self.decoding_iter += 1
        self.result.aqueue.put_nowait(Response(
            self.pending, self.pending_logprobs, finish, self.decoding_iter, ctx_params, error))
        self.pending, self.pending_logprobs = [], []
        if finish is not None or error is not None:
            self.state = DONE
