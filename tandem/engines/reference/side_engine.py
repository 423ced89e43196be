"""What the reference engines of the workers that generate no tokens share (an embedding
worker's, an encode worker's): they keep no KV cache, refuse prompts, count the calls running
and refuse calls once closed."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tandem.engines.base import Engine
from tandem.engines.stream import RequestStream
from tandem.engines.types import EngineRequest, EngineStats, KvLayout
from tandem.errors import Unavailable, Unimplemented


class SideEngine(Engine):
    """An engine of one kind of call (Engine.embed, Engine.encode) and no token generation.

    Subclasses name what they are (`what`, for the error after close) and why prompts are
    refused (`refusal`), and run each call inside `running()`.
    """

    name = "reference"
    #: The engine in an error message: "the embedding engine".
    what: str = "the engine"
    #: Why add_request is refused: which worker this is and where prompts go.
    refusal: str = "this worker generates no tokens"

    def __init__(self, dtype: torch.dtype, max_model_len: int, block_size: int) -> None:
        super().__init__()
        self._layout = KvLayout(str(dtype).removeprefix("torch."), 0, 0, 0, block_size)
        self._max_model_len = max_model_len
        self._num_running = 0
        self._closed = False

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def start(self) -> None:
        return None

    def add_request(self, request: EngineRequest) -> RequestStream:
        raise Unimplemented(self.refusal)

    def abort(self, request_id: str) -> bool:
        return False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One call: refused with Unavailable once closed, counted in `stats` while it runs."""
        if self._closed:
            raise Unavailable(f"{self.what} is closed")
        self._num_running += 1
        try:
            yield
        finally:
            self._num_running -= 1

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self._num_running, num_waiting=0, kv_blocks_used=0, kv_blocks_total=0,
            pending_prefill_tokens=0, active_decode_blocks=0, prefix_cache_hit_rate=0.0)

    async def close(self) -> None:
        self._closed = True
