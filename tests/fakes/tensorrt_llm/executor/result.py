"""Fake of tensorrt_llm/executor/result.py (NVIDIA/TensorRT-LLM @ 005bc848).

Kept from upstream: CompletionOutput's fields (cumulative `token_ids`, `finish_reason` in
{'stop','length','timeout','cancelled'}, `disaggregated_params`); GenerationResult is its own
async iterator (each step returns the same, updated object) and awaitable, `finished` turns
true with the final response, `abort()` only asks the executor to cancel; a context response
turns into `DisaggregatedParams(request_type="context_only", ...)`; for a generation-only
streaming request the first response's diff skips the context server's token
(`decoding_iter == 2`). IterationResult keeps upstream's AsyncQueue timeouts: timeout None
waits, > 0 ends the iteration after that long without data (and stays done until the next
submitted request calls mark_undone), <= 0 on an empty queue raises asyncio.QueueEmpty
(tensorrt_llm/llmapi/utils.py AsyncQueue.get).
"""
from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from tensorrt_llm.disaggregated_params import DisaggregatedParams
from tensorrt_llm.executor.utils import RequestError


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: Any = None
    disaggregated_params: DisaggregatedParams | None = None
    request_perf_metrics: Any = None
    _last_token_ids_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


@dataclass
class Response:
    """Stand-in for the C++ executor's Response (one per step, or one at the end)."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None
    decoding_iter: int
    context_phase_params: dict[str, Any] | None = None
    error: str | None = None


class GenerationResult:
    def __init__(self, request_id: int, sampling_params: Any, executor: Any, streaming: bool,
                 disaggregated_params: DisaggregatedParams | None,
                 prompt_token_ids: list[int]) -> None:
        self.id = request_id
        self.sampling_params = sampling_params
        self.disaggregated_params = disaggregated_params
        self.decoding_iter = 0
        self._streaming = streaming
        self._done = False
        self._aborted = False
        self._executor = executor
        self._prompt_token_ids = prompt_token_ids
        self._outputs = [CompletionOutput(i) for i in range(sampling_params.n)]
        self.aqueue: asyncio.Queue[Response] = asyncio.Queue()

    @property
    def request_id(self) -> int:
        return self.id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _handle_response(self, response: Response) -> None:
        if response.error is not None:
            self._done = True
            raise RequestError(response.error)
        self.decoding_iter = response.decoding_iter
        if response.context_phase_params is not None:
            self.disaggregated_params = DisaggregatedParams(
                request_type="context_only", **response.context_phase_params)
        output = self._outputs[0]
        output.disaggregated_params = self.disaggregated_params
        output._last_token_ids_len = len(output.token_ids)
        output.token_ids.extend(response.token_ids)
        output.logprobs.extend(response.logprobs)
        if (self.disaggregated_params is not None
                and self.disaggregated_params.request_type == "generation_only"
                and self._streaming and self.decoding_iter == 2):
            output._last_token_ids_len = 1
        if response.finish_reason is not None:
            output.finish_reason = response.finish_reason
            self._done = True

    async def _aresult_step(self) -> None:
        self._handle_response(await self.aqueue.get())

    async def aresult(self) -> GenerationResult:
        while not self._done:
            await self._aresult_step()
        return self

    def __await__(self) -> Generator[Any, None, GenerationResult]:
        return self.aresult().__await__()

    def __aiter__(self) -> GenerationResult:
        return self

    async def __anext__(self) -> GenerationResult:
        if self._done:
            raise StopAsyncIteration
        await self._aresult_step()
        return self


class _AsyncQueue:
    def __init__(self, maxlen: int | None = None) -> None:
        self._q: collections.deque[str] = collections.deque(maxlen=maxlen)
        self._event = asyncio.Event()

    def put(self, item: str) -> None:
        self._q.append(item)
        self._event.set()

    async def get(self, timeout: float | None = None) -> str:
        if timeout is None:
            while not self._q:
                await self._event.wait()
        elif timeout > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while not self._q:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise asyncio.TimeoutError()
                await asyncio.wait_for(self._event.wait(), timeout=remaining)
        elif not self._q:
            raise asyncio.QueueEmpty()
        item = self._q.popleft()
        if not self._q:
            self._event.clear()
        return item


class IterationResult:
    def __init__(self, maxlen: int | None = None) -> None:
        self._done = False
        self._timeout: float | None = 2
        self.aqueue = _AsyncQueue(maxlen)

    def set_timeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def mark_undone(self) -> None:
        self._done = False

    def __aiter__(self) -> IterationResult:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done:
            raise StopAsyncIteration
        try:
            data = await self.aqueue.get(timeout=self._timeout)
        except asyncio.TimeoutError:
            self._done = True
            raise StopAsyncIteration from None
        result: dict[str, Any] = json.loads(data)
        return result


class EmptyAsyncIterable:
    """What upstream returns from aget_stats before any request was submitted."""

    def __aiter__(self) -> EmptyAsyncIterable:
        return self

    async def __anext__(self) -> dict[str, Any]:
        raise StopAsyncIteration
