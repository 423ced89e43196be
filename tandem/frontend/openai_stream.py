"""Turns the pipeline's deltas into OpenAI response bodies: SSE events for a stream, one body
for a non-streamed answer. Chat and completions differ only in which builders they use.

A chat answer's text goes through its ChatOutput (tandem.frontend.chat_output): reasoning
becomes `reasoning_content`, tool calls become `tool_calls` (streamed OpenAI's way: a call's
first chunk carries its index, id, type and name with arguments "", later chunks argument
fragments), the rest is `content`, and no markup reaches the client. What the parsers held back
is flushed before the final chunk. A delta's logprobs ride on its first chunk.

With `n` choices every chunk carries its choice's index (Delta.index), each choice has its own
parser state and finish chunk, and the usage chunk (stream_options.include_usage) follows the
last choice's finish with the usage of all (tandem.frontend.choices.total_usage)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tandem.engines.types import FinishReason, TokenLogprob, Usage
from tandem.frontend import openai_response as resp
from tandem.frontend.chat_output import ChatOutput, OutputDelta
from tandem.frontend.choices import total_usage
from tandem.frontend.openai_request import ParsedRequest
from tandem.frontend.parsers import ToolCallStart, collect
from tandem.frontend.pipeline import Delta

JsonDict = resp.JsonDict


@dataclass(slots=True)
class _Choice:
    """One choice's state: its output splitter, completions' logprob text offset, and (for a
    non-streamed answer) what it collected."""

    index: int
    output: ChatOutput
    text_offset: int = 0
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: FinishReason = FinishReason.STOP


class OpenAIResponder:
    """Builds the bodies of one request. `token_text` maps a token id to its text (logprobs);
    `new_output` makes the splitter of a chat answer (Frontend.chat_output), one per choice;
    None: text passes unchanged."""

    def __init__(self, parsed: ParsedRequest, model: str, token_text: Callable[[int], str],
                 new_output: Callable[[], ChatOutput] | None = None) -> None:
        self.is_chat = parsed.kind == "chat"
        self.include_usage = parsed.include_usage
        self.want_logprobs = parsed.logprobs is not None
        self.model = model
        self.token_text = token_text
        self.id = resp.new_completion_id(parsed.kind)
        self.created = resp.created_now()
        make = new_output if new_output is not None and self.is_chat else ChatOutput
        self._choices = [_Choice(i, make()) for i in range(parsed.num_generated)]
        self.num_returned = parsed.n
        self._usage: dict[int, Usage] = {}

    @property
    def usage(self) -> Usage | None:
        """The usage of every choice that finished so far (None before the first)."""
        return total_usage(self._usage)

    def _logprobs(self, choice: _Choice, logprobs: list[TokenLogprob]) -> JsonDict | None:
        if not self.want_logprobs:
            return None
        if self.is_chat:
            return resp.chat_logprobs(logprobs, self.token_text)
        body, choice.text_offset = resp.completion_logprobs(logprobs, self.token_text,
                                                            choice.text_offset)
        return body

    def first_events(self) -> list[JsonDict]:
        """Events sent before any token (the chat role delta of each choice)."""
        if not self.is_chat:
            return []
        return [resp.chat_chunk_first(self.id, self.model, self.created, c.index)
                for c in self._choices]

    def delta_events(self, delta: Delta) -> list[JsonDict]:
        choice = self._choices[delta.index]
        if choice.output.is_plain:
            events = self._plain_events(choice, delta)
        else:
            out = choice.output.feed(delta.text)
            if delta.finish_reason is not None:
                out.extend(choice.output.finish())
            events = self._parsed_events(choice, out, delta.logprobs)
        if delta.finish_reason is not None:
            events.extend(self._final_events(choice, delta.finish_reason, delta.usage))
        return events

    def _plain_events(self, choice: _Choice, delta: Delta) -> list[JsonDict]:
        if not (delta.text or (self.want_logprobs and delta.logprobs)):
            return []
        logprobs = self._logprobs(choice, delta.logprobs)
        if self.is_chat:
            return [resp.chat_chunk(self.id, self.model, self.created, delta.text, logprobs,
                                    choice.index)]
        return [resp.completion_chunk(self.id, self.model, self.created, delta.text, logprobs,
                                      index=choice.index)]

    def _parsed_events(self, choice: _Choice, out: OutputDelta,
                       logprobs: list[TokenLogprob]) -> list[JsonDict]:
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
        lp = self._logprobs(choice, logprobs) if self.want_logprobs and logprobs else None
        if lp is not None and not deltas:
            deltas.append({})
        return [resp.chat_chunk_delta(self.id, self.model, self.created, d,
                                      lp if i == 0 else None, choice.index)
                for i, d in enumerate(deltas)]

    def _final_events(self, choice: _Choice, reason: FinishReason,
                      usage: Usage | None) -> list[JsonDict]:
        if self.is_chat:
            events = [resp.chat_chunk_last(self.id, self.model, self.created, reason,
                                           choice.output.num_calls > 0, choice.index)]
        else:
            events = [resp.completion_chunk(self.id, self.model, self.created, "", None, reason,
                                            choice.index)]
        if usage is not None:
            self._usage[choice.index] = usage
        total = self.usage
        if self.include_usage and total is not None and len(self._usage) == len(self._choices):
            build = resp.chat_chunk_usage if self.is_chat else resp.completion_chunk_usage
            events.append(build(self.id, self.model, self.created, total))
        return events

    async def collect(self, deltas: AsyncIterator[Delta]) -> JsonDict:
        """The whole non-streamed answer (every choice)."""
        async for delta in deltas:
            choice = self._choices[delta.index]
            choice.texts.append(delta.text)
            choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                choice.reason = delta.finish_reason
                if delta.usage is not None:
                    self._usage[choice.index] = delta.usage
        usage = self.usage or Usage(0, 0)
        bodies = [self._collected(choice, usage) for choice in self._best()]
        return bodies[0] if len(bodies) == 1 else resp.with_choices(bodies, usage)

    def _best(self) -> list[_Choice]:
        """The choices to return: all of them, or with best_of the n of highest mean token
        logprob, best first and renumbered 0..n-1 (the usage still counts every one)."""
        choices = self._choices
        if len(choices) == self.num_returned:
            return choices

        def mean_logprob(choice: _Choice) -> float:
            return sum(lp.logprob for lp in choice.logprobs) / max(len(choice.logprobs), 1)

        best = sorted(choices, key=mean_logprob, reverse=True)[:self.num_returned]
        for index, choice in enumerate(best):
            choice.index = index
        return best

    def _collected(self, choice: _Choice, usage: Usage) -> JsonDict:
        text = "".join(choice.texts)
        logprobs = self._logprobs(choice, choice.logprobs)
        if not self.is_chat:
            return resp.text_completion(self.id, self.model, self.created, text, choice.reason,
                                        usage, logprobs, choice.index)
        output = choice.output
        if output.is_plain:
            return resp.chat_completion(self.id, self.model, self.created, text, choice.reason,
                                        usage, logprobs, index=choice.index)
        out = output.feed(text)
        out.extend(output.finish())
        calls = [resp.tool_call(c.id, c.name, c.arguments) for c in collect(out.calls).calls]
        return resp.chat_completion(
            self.id, self.model, self.created, out.content, choice.reason, usage, logprobs,
            tool_calls=calls, reasoning=out.reasoning if output.found_reasoning else None,
            index=choice.index)
