"""One request in flight: a TensorRT-LLM result (RequestOutput) driven into a RequestStream.

The result is async-iterable and yields itself after each engine response, with
`outputs[0].token_ids` cumulative (tensorrt_llm/executor/result.py); the stream gets the new
tokens only. For a generation-only request the first response already holds the context
worker's token (first_gen_tokens) ahead of the new one, which is how the decode stream comes to
emit the prefill worker's first token first.

Cancellation of a generation-only request is deferred: `abort()` while its KV is still being
transferred interrupts the transfer and leaks the blocks it holds, on both workers
(ai-dynamo/dynamo#7489; Dynamo's _DeferredAbort in request_handlers/handler_base.py). The
stream ends CANCELLED at once; `abort()` reaches TensorRT-LLM when the first result arrives,
i.e. once the transfer completed. Until then the blocks stay TensorRT-LLM's.
"""
from __future__ import annotations

import logging
from typing import Any

from tandem.engines.stream import RequestStream
from tandem.engines.trtllm.sampling import finish_reason, token_logprob
from tandem.engines.types import EngineRequest, FinishReason, TokenLogprob, Usage
from tandem.errors import Unavailable

log = logging.getLogger(__name__)


class Flight:
    def __init__(self, request: EngineRequest, result: Any, defer_abort: bool) -> None:
        self.request = request
        self.result = result
        self.stream = RequestStream(request.request_id)
        self.cancelled = False
        self._defer_abort = defer_abort
        self._seen_result = False
        self._abort_pending = False
        self._num_emitted = 0

    @property
    def abort_pending(self) -> bool:
        """Cancelled, with TensorRT-LLM's abort waiting for the first result."""
        return self._abort_pending

    def cancel(self) -> bool:
        """Ends the stream CANCELLED and aborts in TensorRT-LLM (deferred, see module doc).
        False when the request had already ended."""
        if self.cancelled or self.stream.is_finished:
            return False
        self.cancelled = True
        self.stream.finish(FinishReason.CANCELLED, self._usage())
        if self._defer_abort and not self._seen_result:
            self._abort_pending = True
        else:
            self.result.abort()
        return True

    async def drive(self) -> None:
        """Iterates the result to its end (after a cancel too, so that TensorRT-LLM's final
        response is consumed)."""
        try:
            async for res in self.result:
                if not self._seen_result:
                    self._seen_result = True
                    if self._abort_pending:
                        self._abort_pending = False
                        self.result.abort()
                if not self.cancelled:
                    self._emit(res)
        except Exception as exc:  # a per-request failure (RequestError) ends only this stream
            if not self.cancelled:
                log.warning("TensorRT-LLM request %s failed: %s", self.request.request_id, exc)
                self.stream.fail(Unavailable(
                    f"TensorRT-LLM failed request '{self.request.request_id}': {exc}"))
        if not self.stream.is_finished:  # the result ended without a final response
            self.stream.fail(Unavailable(f"TensorRT-LLM ended request "
                                         f"'{self.request.request_id}' without finishing it"))

    def _emit(self, res: Any) -> None:
        output = res.outputs[0]
        k = self.request.sampling.top_logprobs
        first = self.request.first_token
        for position in range(self._num_emitted, len(output.token_ids)):
            token = int(output.token_ids[position])
            logprob: TokenLogprob | None = None
            if k is not None:
                logprob = (first if position == 0 and first is not None
                           else token_logprob(output, position, token, k))
            self.stream.push(token, logprob)
        self._num_emitted = len(output.token_ids)
        if res.finished:
            reason = finish_reason(output)
            if isinstance(reason, FinishReason):
                self.stream.finish(reason, self._usage())
            else:
                self.stream.fail(reason)

    def _usage(self) -> Usage:
        return Usage(len(self.request.prompt_token_ids), self._num_emitted)
