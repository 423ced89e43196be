"""The grammar of a forced gpt-oss tool call: one harmony call message (see harmony_text.py).

A forced tool_choice (required, or a named function) must not push gpt-oss out of its own format
into bare JSON, so it is enforced as the message gpt-oss writes for a call:

    root     ::= analysis? "<|channel|>commentary to=functions." (call_1 | call_2 | ...)
    analysis ::= "<|channel|>analysis<|message|>" text "<|end|><|start|>assistant"
    call_i   ::= "NAME_i" (" "? "<|constrain|>json" | " json")? "<|message|>" ARGS_i

- The leading analysis message (chain of thought) is allowed, not required; its text may not
  contain `<|`, so no harmony marker (every gpt-oss special token reads `<|...|>`) hides in it.
- The recipient sits after the channel, as gpt-oss writes calls; the content type is optional
  (harmony's `<|constrain|>json`, or ` json` as the gpt-oss chat template renders past calls).
- ARGS_i is the function's parameters schema as Tandem's JSON grammar (strict, with the
  deployment's --json-whitespace: tandem.engines.guided.grammar.to_grammar).
- `<|call|>` ends the call but is not in the grammar: it is one of gpt-oss's EOS tokens, and
  xgrammar never matches a stop token against grammar text; it allows the stop tokens exactly
  when the grammar is complete. The frontend's text ends before it, where the harmony parser
  takes the call as complete.
- One call: gpt-oss makes one call per turn (the call ends the turn; its result comes back in
  the next one), so "required" with parallel_tool_calls still gets one call.

The markers are string literals: xgrammar matches them with the added special tokens (whose text
is the marker), so no token ids are needed and the grammar is the same for every tokenizer. A
tokenizer could also spell a marker with ordinary tokens; that text is the same, so the parsers
read it the same.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from tandem.engines.guided.grammar import to_grammar
from tandem.engines.types import GuidedDecoding, GuidedKind
from tandem.frontend.parsers.harmony_text import (
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTION_PREFIX,
    MESSAGE,
    START,
)

#: Grammars built, most recent kept (a client calling the same tools again reuses its grammar).
CACHE_SIZE = 256
_PREFIX = f"""
root ::= analysis? {json.dumps(f"{CHANNEL}commentary to={FUNCTION_PREFIX}")}
analysis ::= {json.dumps(f"{CHANNEL}analysis{MESSAGE}")} text {json.dumps(f"{END}{START}assistant")}
text ::= ([^<] | "<"+ [^<|])*
"""
_HEADER_END = f"""
content_type ::= (" "? {json.dumps(f"{CONSTRAIN}json")} | " json")?
"""


def forced_call_ebnf(functions: Mapping[str, Mapping[str, Any]], json_whitespace: int) -> str:
    """The EBNF (as xgrammar reads it) of one harmony call to one of `functions` (name ->
    parameters JSON schema), arguments JSON with up to `json_whitespace` whitespace characters
    between tokens (0: compact).

    Raises:
        GrammarError: a parameters schema xgrammar cannot compile.
    """
    # Keys keep their order: xgrammar's strict mode writes properties in the schema's order.
    return _build(json.dumps(list(functions.items())), json_whitespace)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _build(functions_json: str, json_whitespace: int) -> str:
    import xgrammar

    calls = []
    for name, parameters in json.loads(functions_json):
        header = xgrammar.Grammar.from_ebnf(
            f"root ::= {json.dumps(name)} content_type {json.dumps(MESSAGE)}\n{_HEADER_END}")
        arguments = to_grammar(GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(parameters),
                                              json_whitespace=json_whitespace))
        calls.append(xgrammar.Grammar.concat(header, arguments))
    prefix = xgrammar.Grammar.from_ebnf(_PREFIX)
    return str(xgrammar.Grammar.concat(prefix, xgrammar.Grammar.union(*calls)))
