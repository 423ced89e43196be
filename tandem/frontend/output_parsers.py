"""The deployment's output parsers (--tool-call-parser, --reasoning-parser), bound to the
served model's tokenizer: which requests they apply to, how those must be detokenized, and the
per-request ChatOutput that applies them.

- Tool calls are parsed for chat requests with tools and tool_choice "auto". Without a tool
  parser such a request is refused (400): its calls could not be told from its text. A forced
  tool_choice (required or named) needs no parser: it is enforced as bare JSON
  (tandem.frontend.tool_request), unless the tool parser has a grammar of its own for it
  (ToolFormat.forced_grammar: harmony). Then that grammar is the constraint (`forced_guided`)
  and the output is parsed as under "auto", reasoning included.
- Reasoning is split off for every chat request without an output constraint (or whose
  constraint is such a forced-call grammar, which allows reasoning first).
- Where a parser's markers are special tokens of this vocabulary (Llama's `<|python_tag|>`,
  Mistral's `[TOOL_CALLS]`, harmony's markers), the request is detokenized with special tokens
  kept; the other special tokens are then removed from the text before the parsers (unless the
  client itself asked for skip_special_tokens false), so the client sees what it would have.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.engines.types import GuidedDecoding, GuidedKind
from tandem.errors import InvalidRequest
from tandem.frontend.chat_output import ChatOutput
from tandem.frontend.parsed_request import ParsedRequest
from tandem.frontend.parsers import ReasoningParser, ToolParser, reasoning_parser, tool_parser


@dataclass(frozen=True)
class OutputParsers:
    tool: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    #: The text of every special token of the served model's vocabulary.
    special_texts: frozenset[str] = frozenset()
    #: --json-whitespace, for the arguments inside a forced-call grammar (`forced_guided`).
    json_whitespace: int = 0

    @classmethod
    def build(cls, tool_name: str, reasoning_name: str,
              special_texts: frozenset[str]) -> OutputParsers:
        """The parsers named by the flags ("" for none). Raises ValueError for an unknown name,
        listing the valid ones."""
        return cls(tool_parser(tool_name) if tool_name else None,
                   reasoning_parser(reasoning_name) if reasoning_name else None, special_texts)

    def check(self, parsed: ParsedRequest) -> None:
        """Raises InvalidRequest for a request these parsers cannot serve as asked."""
        if parsed.tools is not None and parsed.tools.choice == "auto" and self.tool is None:
            raise InvalidRequest(
                "this deployment has no tool-call parser (--tool-call-parser), so it cannot "
                "honour tool_choice 'auto' (the default when 'tools' is sent): send tool_choice "
                "'required' or a named function (enforced with a JSON grammar), or 'none'",
                param="tool_choice")

    def forced_guided(self, parsed: ParsedRequest) -> GuidedDecoding | None:
        """The constraint of `parsed`'s forced tool_choice in the tool parser's own markup (an
        EBNF grammar); None when the choice is not forced or the parser has no grammar for it
        (then `parsed.guided`, the bare-JSON schema, holds). Built once per set of functions."""
        tools = parsed.tools
        if self.tool is None or tools is None or not tools.is_forced:
            return None
        ebnf = self.tool.forced_grammar(tools.forced_functions(), self.json_whitespace)
        return None if ebnf is None else GuidedDecoding(GuidedKind.GRAMMAR, ebnf)

    def _tool_parser(self, parsed: ParsedRequest) -> ToolParser | None:
        tools = parsed.tools
        if tools is None or tools.choice == "none":
            return None
        return self.tool if tools.choice == "auto" or self._forces_markup(parsed) else None

    def _reasoning_parser(self, parsed: ParsedRequest) -> ReasoningParser | None:
        if parsed.kind != "chat":
            return None
        return self.reasoning if parsed.guided is None or self._forces_markup(parsed) else None

    def _forces_markup(self, parsed: ParsedRequest) -> bool:
        """Whether `parsed`'s forced calls come in the tool parser's markup, not as JSON."""
        return self.forced_guided(parsed) is not None

    def _special_markers(self, parsed: ParsedRequest) -> set[str]:
        """The markers of the parsers `parsed` uses that are special tokens here."""
        markers: set[str] = set()
        for parser in (self._tool_parser(parsed), self._reasoning_parser(parsed)):
            if parser is not None:
                markers.update(m for m in parser.markers if m in self.special_texts)
        return markers

    def skip_special_tokens(self, parsed: ParsedRequest) -> bool:
        """How to detokenize `parsed`: the client's choice, unless a parser needs the special
        tokens."""
        return parsed.skip_special_tokens and not self._special_markers(parsed)

    def new_output(self, parsed: ParsedRequest) -> ChatOutput:
        """The per-request splitter of `parsed`'s answer (plain for a completion)."""
        if parsed.kind != "chat":
            return ChatOutput()
        markers = self._special_markers(parsed)
        dropped = (tuple(sorted(self.special_texts - markers))
                   if markers and parsed.skip_special_tokens else ())
        tool = self._tool_parser(parsed)
        reasoning = self._reasoning_parser(parsed)
        tools = parsed.tools
        # A forced choice that no parser reads is bare JSON, turned into calls whole.
        forced = tools if tools is not None and tools.is_forced and tool is None else None
        max_calls = None if tools is None or tools.parallel else 1
        return ChatOutput(special_texts=dropped,
                          reasoning=reasoning.stream() if reasoning is not None else None,
                          tools=tool.stream() if tool is not None else None,
                          forced=forced, max_calls=max_calls)
