"""GuidedDecoding constraints as xgrammar grammars: the one place that decides how each kind of
constraint reads, shared by the frontend (which checks a constraint before any worker sees it)
and the engines (which compile it against their vocabulary).

xgrammar is imported on first use: a process that never sees a constraint never loads it.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from tandem.engines.types import GuidedDecoding, GuidedKind
from tandem.errors import InvalidRequest

#: Constraints checked (parsed into grammars) and remembered by `check`, most recent kept.
CHECK_CACHE_SIZE = 1024
#: Where xgrammar's C++ layer prefixes its messages ("[12:00:00] /path/file.cc:42: ").
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
#: Most whitespace characters a JSON constraint may allow between two tokens of the JSON text
#: (GuidedDecoding.json_whitespace): room for pretty-printing, but a model that keeps choosing
#: whitespace (a known failure of unbounded JSON grammars) cannot spend its max_tokens on it.
MAX_JSON_WHITESPACE = 64
#: How xgrammar prints the characters of a length-bounded JSON string, and what they must be.
_LOOSE_CHAR = r'[^\"\\\r\n]'
_STRICT_CHAR = r'[^\0-\x1f\"\\]'
#: How xgrammar prints a JSON number's unbounded digit runs, and their bounds (_json_grammar).
_BOUNDED_DIGITS = (("[1-9] [0-9]*", "[1-9] [0-9]{0, 18}"),
                   ("basic_number_digits{1, -1}", "basic_number_digits{1, 18}"))
#: OpenAI's response_format {"type": "json_object"}: any object.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A constraint that is not a valid schema, pattern or grammar (the message says why)."""


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string literals are valid
    xgrammar EBNF string literals, escapes included)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def to_grammar(guided: GuidedDecoding) -> Any:
    """The xgrammar.Grammar of a constraint.

    JSON schemas use xgrammar's strict mode (no property or item the schema does not name, as
    vLLM). Their whitespace is the constraint's json_whitespace: 0 is compact JSON (xgrammar's
    any_whitespace=False: ", " and ": " between tokens, nothing else, as vLLM's
    --disable-any-whitespace); n > 0 lets the model put up to n whitespace characters between
    any two tokens.

    Raises:
        GrammarError: the schema, pattern or grammar is invalid or unsupported.
    """
    xgr = _xgrammar()
    kind = guided.kind
    try:
        if kind is GuidedKind.JSON_SCHEMA:
            return _json_grammar(xgr, guided.spec, guided.json_whitespace)
        if kind is GuidedKind.JSON_OBJECT:
            return _json_grammar(xgr, _JSON_OBJECT_SCHEMA, guided.json_whitespace)
        if kind is GuidedKind.REGEX:
            return xgr.Grammar.from_regex(guided.spec)
        if kind is GuidedKind.CHOICE:
            return xgr.Grammar.from_ebnf(choice_ebnf(guided.choices))
        return xgr.Grammar.from_ebnf(guided.spec)
    except RuntimeError as exc:  # xgrammar reports every parse failure as a RuntimeError
        raise GrammarError(clean_message(exc)) from None


def _json_grammar(xgr: Any, schema: str, whitespace: int) -> Any:
    """A JSON schema's grammar, with two rewrites of the EBNF xgrammar (0.2.x) prints:

    - its length-bounded strings (minLength, maxLength) kept to valid JSON: xgrammar writes
      their characters as _LOOSE_CHAR, which lets raw control characters (a tab, U+0017) into
      a string, where RFC 8259 (and Python's json) forbids them. Rewritten to _STRICT_CHAR, as
      xgrammar's own unbounded strings have it;
    - numbers bounded (_BOUNDED_DIGITS): at most 19 digits before the point (an int64's) and
      18 after it or in the exponent, where xgrammar allows any count, so that a model that
      keeps choosing digits ends its number (a weak model would spend max_tokens on one).
    """
    if whitespace > 0:
        grammar = xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=whitespace)
    else:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = original = str(grammar)
    for loose, bounded in ((_LOOSE_CHAR, _STRICT_CHAR), *_BOUNDED_DIGITS):
        text = text.replace(loose, bounded)
    return grammar if text == original else xgr.Grammar.from_ebnf(text)


def clean_message(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location, on one line."""
    text = str(exc).strip()
    return " ".join(_LOG_PREFIX.sub("", text).split()) or type(exc).__name__


@functools.lru_cache(maxsize=CHECK_CACHE_SIZE)
def _check(key: tuple[GuidedKind, str, tuple[str, ...], int]) -> None:
    kind, spec, choices, whitespace = key
    to_grammar(GuidedDecoding(kind, spec, choices, json_whitespace=whitespace))


def check(guided: GuidedDecoding, param: str) -> None:
    """Parses the constraint into a grammar (remembered, so a repeated constraint costs a
    lookup); a bad one is the client's fault.

    Raises:
        InvalidRequest: naming `param`, with xgrammar's reason.
    """
    try:
        _check(guided.grammar_key)
    except GrammarError as exc:
        raise InvalidRequest(f"'{param}' is not a valid {_WHAT[guided.kind]}: {exc}",
                             param=param) from None


_WHAT = {GuidedKind.JSON_SCHEMA: "JSON schema", GuidedKind.JSON_OBJECT: "JSON object constraint",
         GuidedKind.REGEX: "regular expression", GuidedKind.CHOICE: "choice list",
         GuidedKind.GRAMMAR: "EBNF grammar"}
