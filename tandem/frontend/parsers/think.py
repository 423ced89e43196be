"""`deepseek_r1` and `qwen3`: reasoning between `<think>` and `</think>`, the answer after.

- DeepSeek-R1 writes its chain of thought, then `</think>`, then the answer. Its newer chat
  templates end the prompt with `<think>\\n`, so the output usually lacks the opening tag: text
  before `</think>` is reasoning whether or not `<think>` opened it. An output that never closes
  the block (cut by max_tokens) is all reasoning.
- Qwen3 opens the block itself: `<think>\\n...\\n</think>\\n\\nanswer`. With
  `enable_thinking=False` its template puts an empty block in the prompt and the output holds no
  tags: then everything is content, passed through unchanged. So for qwen3 only an output that
  starts with `<think>` (after whitespace) has reasoning. (Qwen3 "Thinking-2507" models, whose
  template emits the opening tag, are R1-shaped: use `deepseek_r1` for them.)

Whitespace touching the tags is dropped on both sides, so `reasoning_content` and `content`
carry no layout newlines from the tags; text without tags is left as it is.
"""
from __future__ import annotations

import enum

from tandem.frontend.parsers._text import TrimmedText, held_suffix, skip_space
from tandem.frontend.parsers.reasoning import ReasoningStream
from tandem.frontend.parsers.types import ReasoningDelta

OPEN = "<think>"
CLOSE = "</think>"


class _Mode(enum.Enum):
    DETECT = "detect"        # start of output: is there a think block?
    REASONING = "reasoning"  # inside the block
    CONTENT = "content"      # after the block, or no block at all


class ThinkStream(ReasoningStream):
    """The `<think>` splitter; `implicit_open` says the output starts inside the block (R1)."""

    def __init__(self, implicit_open: bool) -> None:
        super().__init__()
        self._implicit_open = implicit_open
        self._buf = ""
        self._mode = _Mode.DETECT
        self._found = False
        self._reasoning = TrimmedText(after_markup=True)
        self._content = TrimmedText()

    @property
    def found_reasoning(self) -> bool:
        return self._found

    def _advance(self, delta: str, eof: bool) -> ReasoningDelta:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        if self._mode is _Mode.DETECT:
            self._detect(eof)
        if self._mode is _Mode.REASONING:
            close = self._buf.find(CLOSE)
            if close >= 0:
                reasoning.append(self._reasoning.push(self._buf[:close]))
                self._reasoning.markup()
                self._content.markup()
                self._buf = self._buf[close + len(CLOSE):]
                self._mode = _Mode.CONTENT
            else:
                n = len(self._buf) - (0 if eof else held_suffix(self._buf, (CLOSE,)))
                reasoning.append(self._reasoning.push(self._buf[:n]))
                self._buf = self._buf[n:]
        if self._mode is _Mode.CONTENT:
            content.append(self._content.push(self._buf))
            self._buf = ""
        if eof:
            reasoning.append(self._reasoning.flush())
            content.append(self._content.flush())
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _detect(self, eof: bool) -> None:
        """Decides whether the output opens with a think block (waits on `<thi`, whitespace)."""
        rest = self._buf[skip_space(self._buf):]
        if rest.startswith(OPEN):
            self._buf = rest[len(OPEN):]
            self._mode = _Mode.REASONING
        elif OPEN.startswith(rest) and not eof:
            return
        elif self._implicit_open:
            self._mode = _Mode.REASONING
        else:
            self._mode = _Mode.CONTENT
        self._found = self._mode is _Mode.REASONING
