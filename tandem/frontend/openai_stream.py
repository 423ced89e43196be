"""Turns the pipeline's deltas into OpenAI response bodies: SSE events for a stream, one body
for a non-streamed answer. Chat and completions differ only in which builders they use.

A chat answer's text goes through its ChatOutput (tandem.frontend.chat_output): reasoning
becomes `reasoning_content`, tool calls become `tool_calls` (streamed OpenAI's way: a call's
first chunk carries its index, id, type and name with arguments "", later chunks argument
fragments), the rest is `content`, and no markup reaches the client. What the parsers held back
is flushed before the final chunk. A delta's logprobs ride on its first chunk."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from tandem.engines.types import FinishReason, TokenLogprob, Usage
from tandem.frontend import openai_response as resp
from tandem.frontend.chat_output import ChatOutput, OutputDelta
from tandem.frontend.openai_request import ParsedRequest
from tandem.frontend.parsers import ToolCallStart, collect
from tandem.frontend.pipeline import Delta

JsonDict = resp.JsonDict


class OpenAIResponder:
    """Builds the bodies of one request. `token_text` maps a token id to its text (logprobs);
    `output` splits a chat answer (Frontend.chat_output); None: text passes unchanged."""

    def __init__(self, parsed: ParsedRequest, model: str, token_text: Callable[[int], str],
                 output: ChatOutput | None = None) -> None:
        self.is_chat = parsed.kind == "chat"
        self.include_usage = parsed.include_usage
        self.want_logprobs = parsed.logprobs is not None
        self.model = model
        self.token_text = token_text
        self.output = output if output is not None and self.is_chat else ChatOutput()
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
        if self.output.is_plain:
            events = self._plain_events(delta)
        else:
            out = self.output.feed(delta.text)
            if delta.finish_reason is not None:
                out.extend(self.output.finish())
            events = self._parsed_events(out, delta.logprobs)
        if delta.finish_reason is not None:
            events.extend(self._final_events(delta.finish_reason, delta.usage))
        return events

    def _plain_events(self, delta: Delta) -> list[JsonDict]:
        if not (delta.text or (self.want_logprobs and delta.logprobs)):
            return []
        logprobs = self._logprobs(delta.logprobs)
        if self.is_chat:
            return [resp.chat_chunk(self.id, self.model, self.created, delta.text, logprobs)]
        return [resp.completion_chunk(self.id, self.model, self.created, delta.text, logprobs)]

    def _parsed_events(self, out: OutputDelta, logprobs: list[TokenLogprob]) -> list[JsonDict]:
        deltas: list[JsonDict] = []
        if out.reasoning:
            deltas.append({"reasoning_content": out.reasoning})
        if out.content:
            deltas.append({"content": out.content})
        for event in out.calls:
            entry = (resp.tool_call_start(event.index, event.id, event.name)
                     if isinstance(event, ToolCallStart) else
                     resp.tool_call_arguments(event.index, event.fragment))
            deltas.append({"tool_calls": [entry]})
        lp = self._logprobs(logprobs) if self.want_logprobs and logprobs else None
        if lp is not None and not deltas:
            deltas.append({})
        return [resp.chat_chunk_delta(self.id, self.model, self.created, d,
                                      lp if i == 0 else None) for i, d in enumerate(deltas)]

    def _final_events(self, reason: FinishReason, usage: Usage | None) -> list[JsonDict]:
        if self.is_chat:
            events = [resp.chat_chunk_last(self.id, self.model, self.created, reason,
                                           self.output.num_calls > 0)]
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
        text = "".join(texts)
        if not self.is_chat:
            return resp.text_completion(self.id, self.model, self.created, text, reason, usage,
                                        self._logprobs(logprobs))
        if self.output.is_plain:
            return resp.chat_completion(self.id, self.model, self.created, text, reason, usage,
                                        self._logprobs(logprobs))
        out = self.output.feed(text)
        out.extend(self.output.finish())
        calls = [resp.tool_call(c.id, c.name, c.arguments) for c in collect(out.calls).calls]
        return resp.chat_completion(
            self.id, self.model, self.created, out.content, reason, usage,
            self._logprobs(logprobs), tool_calls=calls,
            reasoning=out.reasoning if self.output.found_reasoning else None)
