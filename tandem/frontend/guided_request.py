"""Structured-output fields of an OpenAI request body, as one GuidedDecoding constraint.

Accepted, at most one per request (two are a 400 naming both):
  - OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
  - vLLM's `guided_json` (a schema object, or a string holding one), `guided_regex`,
    `guided_choice` (an array of strings) and `guided_grammar` (EBNF as xgrammar reads it);
  - NVIDIA Dynamo's copies of those in `nvext` (`nvext.guided_json`, ...: lib/llm/src/
    protocols/openai/nvext.rs). Dynamo's `nvext.guided_decoding_backend` and
    `guided_whitespace_pattern` are accepted and ignored, like vLLM's top-level ones: every
    engine here enforces with xgrammar, and the frontend's --json-whitespace decides the
    whitespace of JSON output (compact by default: tandem.engines.guided.grammar).

Every constraint is parsed into a grammar here (tandem.engines.guided.grammar.check, cached), so
that an invalid schema, pattern or grammar is a 400 naming its field and never reaches a worker.
A JSON schema's `strict` flag is validated and otherwise ignored: the schema is always enforced,
in xgrammar's strict mode (as vLLM).
"""
from __future__ import annotations

import json
from typing import Any

from tandem.engines.guided.grammar import check
from tandem.engines.types import GuidedDecoding, GuidedKind
from tandem.errors import InvalidRequest
from tandem.frontend import json_body

_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_guided(body: dict[str, Any], nvext: dict[str, Any]) -> GuidedDecoding | None:
    """The request's constraint, None without one.

    Raises:
        InvalidRequest: a field of the wrong shape, two constraints, or one that is not a
            valid schema, pattern or grammar; `param` names the field.
    """
    found: list[tuple[str, GuidedDecoding]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(response_format)
    for source, prefix in ((body, ""), (nvext, "nvext.")):
        for key, parse in _VLLM_FIELDS.items():
            value = source.get(key)
            if value is not None:
                found.append((prefix + key, parse(value, prefix + key)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{param}'" for param, _ in found)
        raise InvalidRequest(f"a request takes at most one structured-output constraint, got "
                             f"{names}", param=found[1][0])
    param, guided = found[0]
    check(guided, param)
    return guided


def _response_format(value: object) -> tuple[str, GuidedDecoding] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _must("response_format", "an object", value)
    kind = value.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise InvalidRequest(f"'response_format.type' must be one of {', '.join(_RESPONSE_FORMATS)}"
                             f", got {kind!r}", param="response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", GuidedDecoding(GuidedKind.JSON_OBJECT)
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise _must(where, "an object with 'name' and 'schema'", spec)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' must be a non-empty string", param=f"{where}.name")
    for key, kind_name in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_name):
            raise _must(f"{where}.{key}", "a boolean" if kind_name is bool else "a string",
                        spec[key])
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _must(f"{where}.schema", "a JSON schema object", schema)
    return f"{where}.schema", GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(schema))


def _json(value: object, param: str) -> GuidedDecoding:
    if isinstance(value, str):
        value = json_body.loads(value, f"'{param}' (a string)", param)
    if not isinstance(value, dict):
        raise _must(param, "a JSON schema object (or a string holding one)", value)
    return GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(value))


def _text(kind: GuidedKind) -> Any:
    def parse(value: object, param: str) -> GuidedDecoding:
        if not isinstance(value, str) or not value:
            raise _must(param, "a non-empty string", value)
        return GuidedDecoding(kind, value)
    return parse


def _choice(value: object, param: str) -> GuidedDecoding:
    if not isinstance(value, list) or not value:
        raise _must(param, "a non-empty array of strings", value)
    for item in value:
        if not isinstance(item, str):
            raise _must(param, "an array of strings", item)
    return GuidedDecoding(GuidedKind.CHOICE, choices=tuple(value))


_VLLM_FIELDS = {"guided_json": _json, "guided_regex": _text(GuidedKind.REGEX),
                "guided_choice": _choice, "guided_grammar": _text(GuidedKind.GRAMMAR)}


def _must(param: str, what: str, value: object) -> InvalidRequest:
    kind = "null" if value is None else type(value).__name__
    return InvalidRequest(f"'{param}' must be {what}, got {_JSON.get(kind, kind)}", param=param)


_JSON = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
         "list": "array", "dict": "object"}
