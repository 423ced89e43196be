"""OpenAI's harmony response format (gpt-oss), read from decoded text.

An assistant turn is a sequence of messages `<|start|>{header}<|message|>{body}{end}`, where the
end token is `<|end|>` (more messages follow), `<|call|>` (a tool call: stop) or `<|return|>`
(the final answer: stop). The prompt ends with `<|start|>assistant`, so the first message of the
output begins directly with its channel. The header holds the role, `<|channel|>` and the channel
name (`analysis`: chain of thought; `commentary`: tool calls and preambles for the user; `final`:
the answer), an optional recipient `to=functions.NAME` (in the role part or after the channel),
and an optional content type, usually `<|constrain|>json`:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>

Why text and not the `openai-harmony` package: its parser works on token ids of the
`o200k_harmony` encoding, and loading that encoding downloads the tiktoken vocabulary
(`o200k_base.tiktoken`, from openaipublic.blob.core.windows.net) at first use, which cannot be
done offline. The frontend has the decoded text anyway; the harmony markers are special tokens,
so the text must be decoded with special tokens kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
#: Tokens that end a message body.
END_TOKENS = (END, CALL, RETURN)
#: Tokens that open a message header.
HEADER_OPENERS = (START, CHANNEL)
ALL_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
#: A header longer than this without `<|message|>` is not a header (bounds the hold-back).
MAX_HEADER_CHARS = 256
FUNCTION_PREFIX = "functions."


@dataclass(frozen=True)
class Header:
    """A message header: channel (may be empty), recipient (may be empty), content type."""

    channel: str
    recipient: str
    content_type: str

    @property
    def function(self) -> str | None:
        """The function called, for a message addressed to `functions.NAME`."""
        if self.recipient.startswith(FUNCTION_PREFIX) and len(self.recipient) > len(FUNCTION_PREFIX):
            return self.recipient[len(FUNCTION_PREFIX):]
        return None


def read_header(buf: str, eof: bool) -> tuple[Header, int] | Literal[False] | None:
    """Reads the header opening at `buf[0]` (`<|start|>` or `<|channel|>`).

    Returns (header, index just past `<|message|>`); None while `<|message|>` has not arrived;
    False if this is no header (no `<|message|>` in time, or an end token inside).
    """
    limit = MAX_HEADER_CHARS + len(MESSAGE)
    i = buf.find(MESSAGE, 0, limit)
    if i < 0:
        return None if not eof and len(buf) < limit else False
    text = buf[:i]
    if any(token in text for token in (MESSAGE, *END_TOKENS)) or text.count(START) > 1:
        return False
    if text.startswith(START):
        role, _, channel_part = text[len(START):].partition(CHANNEL)
    else:
        role, channel_part = "", text[len(CHANNEL):]
    words = channel_part.replace(CONSTRAIN, " ").split()
    recipient = next((w[3:] for w in (*role.split(), *words) if w.startswith("to=")), "")
    rest = [w for w in words if not w.startswith("to=")]
    channel = rest[0] if rest else ""
    content_type = rest[1] if len(rest) > 1 else ""
    return Header(channel, recipient, content_type), i + len(MESSAGE)
