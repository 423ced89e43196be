"""Turns the pipeline's deltas into OpenAI response bodies: SSE events for a stream, one body
for a non-streamed answer. Chat and completions differ only in which builders they use."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from tandem.engines.types import FinishReason, TokenLogprob, Usage
from tandem.frontend import openai_response as resp
from tandem.frontend.openai_request import ParsedRequest
from tandem.frontend.pipeline import Delta

JsonDict = resp.JsonDict


class OpenAIResponder:
    """Builds the bodies of one request. `token_text` maps a token id to its text (logprobs)."""

    def __init__(self, parsed: ParsedRequest, model: str, token_text: Callable[[int], str]) -> None:
        self.is_chat = parsed.kind == "chat"
        self.include_usage = parsed.include_usage
        self.want_logprobs = parsed.logprobs is not None
        self.model = model
        self.token_text = token_text
        self.id = resp.new_completion_id(parsed.kind)
        self.created = resp.created_now()
        self._text_offset = 0

    def _logprobs(self, logprobs: list[TokenLogprob]) -> JsonDict | None:
        if not self.want_logprobs:
            return None
        if self.is_chat:
            return resp.chat_logprobs(logprobs, self.token_text)
        body, self._text_offset = resp.completion_logprobs(logprobs, self.token_text,
                                                           self._text_offset)
        return body

    def first_events(self) -> list[JsonDict]:
        """Events sent before any token (the chat role delta)."""
        return [resp.chat_chunk_first(self.id, self.model, self.created)] if self.is_chat else []

    def delta_events(self, delta: Delta) -> list[JsonDict]:
        events: list[JsonDict] = []
        if delta.text or (self.want_logprobs and delta.logprobs):
            logprobs = self._logprobs(delta.logprobs)
            events.append(resp.chat_chunk(self.id, self.model, self.created, delta.text, logprobs)
                          if self.is_chat else
                          resp.completion_chunk(self.id, self.model, self.created, delta.text,
                                                logprobs))
        if delta.finish_reason is not None:
            events.extend(self._final_events(delta.finish_reason, delta.usage))
        return events

    def _final_events(self, reason: FinishReason, usage: Usage | None) -> list[JsonDict]:
        if self.is_chat:
            events = [resp.chat_chunk_last(self.id, self.model, self.created, reason)]
        else:
            events = [resp.completion_chunk(self.id, self.model, self.created, "", None, reason)]
        if self.include_usage and usage is not None:
            build = resp.chat_chunk_usage if self.is_chat else resp.completion_chunk_usage
            events.append(build(self.id, self.model, self.created, usage))
        return events

    async def collect(self, deltas: AsyncIterator[Delta]) -> JsonDict:
        """The whole non-streamed answer."""
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        reason, usage = FinishReason.STOP, Usage(0, 0)
        async for delta in deltas:
            texts.append(delta.text)
            logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                reason, usage = delta.finish_reason, delta.usage or usage
        build = resp.chat_completion if self.is_chat else resp.text_completion
        return build(self.id, self.model, self.created, "".join(texts), reason, usage,
                     self._logprobs(logprobs))
