"""The per-request channel between an engine's step loop and the service that streams tokens."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.engines.types import FinishReason, TokenChunk, TokenLogprob, Usage


class RequestStream:
    """Tokens of one request, produced by the engine and drained by one consumer.

    The engine calls push/finish/fail from the event loop's thread; the consumer iterates. Each
    iteration returns every token produced since the previous one, so a slow consumer gets fewer,
    larger chunks instead of falling behind. Iteration ends after the chunk carrying finish_reason.

    A consumer serving many streams at once (a decode worker's Session) registers a listener
    instead of iterating: it is called when the stream goes from empty to having something to
    take, and the consumer then calls take() without waiting.
    """

    __slots__ = ("request_id", "_token_ids", "_logprobs", "_finish", "_usage", "_error",
                 "_ready", "_drained", "_cached_tokens", "_prompt_logprobs", "_listener",
                 "_pending")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._finish: FinishReason | None = None
        self._usage: Usage | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._drained = False
        self._cached_tokens: int | None = None
        self._prompt_logprobs: list[TokenLogprob] | None = None
        self._listener: Callable[[RequestStream], None] | None = None
        #: Whether something arrived since the last take (the listener is told once per take).
        self._pending = False

    def listen(self, listener: Callable[[RequestStream], None]) -> None:
        """Calls `listener(self)` whenever the stream has something new to take (instead of
        iteration; use one or the other)."""
        self._listener = listener
        if self._pending:
            listener(self)

    def _notify(self) -> None:
        if self._pending:
            return
        self._pending = True
        if self._listener is not None:
            self._listener(self)
        else:
            self._ready.set()

    def set_cached_tokens(self, num_tokens: int) -> None:
        """Prefix-cache hits of the prompt, reported once on the next chunk (engines call this
        when the request is first scheduled)."""
        self._cached_tokens = num_tokens

    def set_prompt_logprobs(self, logprobs: list[TokenLogprob]) -> None:
        """The prompt's logprobs, reported once on the next chunk."""
        self._prompt_logprobs = logprobs

    @property
    def is_finished(self) -> bool:
        return self._finish is not None or self._error is not None

    def push(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        if self.is_finished:
            return  # an engine racing an abort: the stream already ended
        self._token_ids.append(token_id)
        if logprob is not None:
            self._logprobs.append(logprob)
        self._notify()

    def finish(self, reason: FinishReason, usage: Usage) -> None:
        if self.is_finished:
            return
        self._finish = reason
        self._usage = usage
        self._notify()

    def fail(self, error: BaseException) -> None:
        if self.is_finished:
            return
        self._error = error
        self._notify()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._drained:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        return self.take()

    def take(self) -> TokenChunk:
        """Everything produced since the previous take, without waiting (possibly nothing);
        raises the stream's error once it failed. The chunk with finish_reason is the last."""
        self._pending = False
        if self._error is not None:
            self._drained = True
            raise self._error
        chunk = TokenChunk(self._token_ids, self._logprobs, self._finish, self._usage,
                           self._cached_tokens, self._prompt_logprobs)
        self._token_ids, self._logprobs = [], []
        self._cached_tokens = self._prompt_logprobs = None
        if self._finish is not None:
            self._drained = True
        return chunk
