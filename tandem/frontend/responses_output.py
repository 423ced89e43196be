"""One Responses API answer, built from the pipeline's deltas: the streamed events and the
final response object.

Text deltas pass through the request's ChatOutput (tandem.frontend.chat_output), which splits
them into reasoning, content and tool calls. Each part becomes an output item, opened when its
first text arrives and closed when another kind starts or the answer ends:
  - reasoning: output_item.added, content_part.added (reasoning_text),
    reasoning_text.delta*, reasoning_text.done, content_part.done, output_item.done;
  - message: output_item.added, content_part.added (output_text), output_text.delta*,
    output_text.done, content_part.done, output_item.done;
  - function_call: output_item.added, function_call_arguments.delta*,
    function_call_arguments.done, output_item.done.
The stream starts with response.created and response.in_progress and ends with
response.completed, response.incomplete (cut by max_output_tokens: the last item's status is
"incomplete") or response.failed. Every event carries a sequence_number, 0, 1, 2, ...
A non-streamed answer runs the same builder and returns only the final response object.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from tandem.engines.types import FinishReason, Usage
from tandem.frontend import responses_shapes as shapes
from tandem.frontend.chat_output import ChatOutput, OutputDelta
from tandem.frontend.parsers import ToolCallStart
from tandem.frontend.pipeline import Delta
from tandem.frontend.responses_request import ResponsesRequest

JsonDict = shapes.JsonDict


@dataclass
class _OpenItem:
    """The output item receiving text now."""

    kind: str  # "reasoning" | "message" | "function_call"
    output_index: int
    item_id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    #: function_call: the ChatOutput index of the call (its argument fragments carry it).
    call_index: int = -1


class ResponseBuilder:
    """Builds one answer's events and response object. `output` splits the text (one per
    answer: Frontend.chat_output)."""

    def __init__(self, request: ResponsesRequest, model: str, output: ChatOutput) -> None:
        self.id = shapes.new_id("resp")
        self.created_at = shapes.now()
        self.model = model
        self.echo = request.echo
        self._output = output
        self._seq = 0
        self._open: _OpenItem | None = None
        #: Finished output items, in order.
        self.items: list[JsonDict] = []
        self.status = "in_progress"
        self.usage: Usage | None = None
        self._incomplete: str | None = None
        self._error: JsonDict | None = None

    def response(self) -> JsonDict:
        """The response object as it stands (the final one once the answer ended)."""
        usage = None if self.usage is None else shapes.usage_body(self.usage)
        return shapes.response_object(self.id, self.created_at, self.model, self.status,
                                      list(self.items), self.echo, usage, self._incomplete,
                                      self._error)

    def first_events(self) -> list[JsonDict]:
        """response.created and response.in_progress."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def delta_events(self, delta: Delta) -> list[JsonDict]:
        """The events of one delta; after the final delta, the closing events too."""
        out = self._output.feed(delta.text) if delta.text else OutputDelta()
        if delta.finish_reason is not None:
            out.extend(self._output.finish())
        events = self._apply(out)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason, delta.usage)
        return events

    def failed_events(self, code: str, message: str) -> list[JsonDict]:
        """The events that end a stream that failed after it started: response.failed."""
        self.status = "failed"
        self._error = {"code": code, "message": message}
        return [self._event("response.failed", response=self.response())]

    async def collect(self, deltas: AsyncIterator[Delta]) -> JsonDict:
        """The final response object of a non-streamed answer."""
        async for delta in deltas:
            self.delta_events(delta)
        return self.response()

    # --- items ----------------------------------------------------------------------------------

    def _apply(self, out: OutputDelta) -> list[JsonDict]:
        events: list[JsonDict] = []
        if out.reasoning:
            events += self._text("reasoning", out.reasoning)
        if out.content:
            events += self._text("message", out.content)
        for call in out.calls:
            if isinstance(call, ToolCallStart):
                events += self._close()
                events += self._open_call(call)
            elif self._open is not None and self._open.call_index == call.index:
                self._open.text += call.fragment
                events.append(self._item_event("response.function_call_arguments.delta",
                                               delta=call.fragment))
        return events

    def _text(self, kind: str, text: str) -> list[JsonDict]:
        events: list[JsonDict] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            events += self._open_text(kind)
        assert self._open is not None
        self._open.text += text
        name = ("response.reasoning_text.delta" if kind == "reasoning"
                else "response.output_text.delta")
        extra: JsonDict = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._item_event(name, content_index=0, delta=text, **extra))
        return events

    def _open_text(self, kind: str) -> list[JsonDict]:
        is_reasoning = kind == "reasoning"
        item = _OpenItem(kind, len(self.items), shapes.new_id("rs" if is_reasoning else "msg"))
        self._open = item
        added = (shapes.reasoning_item if is_reasoning else shapes.message_item)(
            item.item_id, "in_progress")
        part = shapes.reasoning_part("") if is_reasoning else shapes.text_part("")
        return [self._event("response.output_item.added", output_index=item.output_index,
                            item=added),
                self._item_event("response.content_part.added", content_index=0, part=part)]

    def _open_call(self, call: ToolCallStart) -> list[JsonDict]:
        item = _OpenItem("function_call", len(self.items), shapes.new_id("fc"),
                         call_id=call.id, name=call.name, call_index=call.index)
        self._open = item
        added = shapes.function_call_item(item.item_id, call.id, call.name, "", "in_progress")
        return [self._event("response.output_item.added", output_index=item.output_index,
                            item=added)]

    def _close(self, status: str = "completed") -> list[JsonDict]:
        item = self._open
        if item is None:
            return []
        if item.kind == "function_call":
            done = shapes.function_call_item(item.item_id, item.call_id, item.name, item.text,
                                             status)
            events = [self._item_event("response.function_call_arguments.done",
                                       arguments=item.text, name=item.name)]
        else:
            is_reasoning = item.kind == "reasoning"
            build = shapes.reasoning_item if is_reasoning else shapes.message_item
            done = build(item.item_id, status, item.text)
            if is_reasoning:
                events = [self._item_event("response.reasoning_text.done", content_index=0,
                                           text=item.text)]
            else:
                events = [self._item_event("response.output_text.done", content_index=0,
                                           text=item.text, logprobs=[])]
            events.append(self._item_event("response.content_part.done", content_index=0,
                                           part=done["content"][0]))
        self._open = None
        self.items.append(done)
        events.append(self._event("response.output_item.done", output_index=item.output_index,
                                  item=done))
        return events

    def _finish(self, reason: FinishReason, usage: Usage | None) -> list[JsonDict]:
        cut = reason is FinishReason.LENGTH
        events = self._close("incomplete" if cut else "completed")
        self.usage = usage
        if cut:
            self.status, self._incomplete = "incomplete", "max_output_tokens"
            return events + [self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return events + [self._event("response.completed", response=self.response())]

    # --- events ---------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: object) -> JsonDict:
        event: JsonDict = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _item_event(self, kind: str, **fields: object) -> JsonDict:
        item = self._open
        assert item is not None
        return self._event(kind, item_id=item.item_id, output_index=item.output_index, **fields)
