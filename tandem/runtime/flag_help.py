"""Help text for config flags, read from the config classes' own source.

A config class documents each field in the `#:` comment lines right above it (Sphinx's
convention, so that the comment a reader sees in the source and the `--help` line are one text),
and sorts its fields by concern with heading lines in its body:

    # == network ==
    #: Port of the gRPC API.
    port: int = 9200

The heading applies to every field after it, up to the next heading; a nested config class
without headings takes the heading of the field that holds it. `--help` shows one section per
concern, in the order of GROUPS, and each flag's text ends with its default and its environment
variable, which are therefore never written by hand.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any

#: Sections of --help, in the order they are shown.
GROUPS = ("general", "network", "model and engine", "batching and scheduling", "KV cache",
          "parallelism", "routing", "disaggregation", "multimodal", "reliability", "security",
          "observability", "mock engine", "TensorRT-LLM engine", "testing")

_HEADING = re.compile(r"^\s*#\s*==\s*(?P<name>[^=]+?)\s*==\s*$")
_DOC = re.compile(r"^\s*#:\s?(?P<text>.*)$")


@dataclass(frozen=True)
class FieldHelp:
    #: What the field does, with its unit ("" when the source has no `#:` comment).
    text: str
    #: Its section of --help ("" when no heading precedes it).
    group: str


@functools.cache
def field_help(cls: type) -> dict[str, FieldHelp]:
    """The documentation of each field of the dataclass `cls`, by field name. Raises ValueError
    for a heading that is not one of GROUPS (a typo must not open a section of its own)."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    body = ast.parse("\n".join(lines)).body[0]
    assert isinstance(body, ast.ClassDef)
    field_lines = {stmt.lineno - 1: stmt.target.id for stmt in body.body
                   if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
    result: dict[str, FieldHelp] = {}
    group, doc = "", []
    for index, line in enumerate(lines):
        if heading := _HEADING.match(line):
            group = heading["name"]
            if group not in GROUPS:
                raise ValueError(f"{cls.__qualname__}: unknown help group {group!r} "
                                 f"(known: {', '.join(GROUPS)})")
        elif comment := _DOC.match(line):
            doc.append(comment["text"].strip())
        elif index in field_lines:
            result[field_lines[index]] = FieldHelp(" ".join(doc).strip(), group)
            doc = []
        elif line.strip() and not line.strip().startswith("#"):
            doc = []  # a comment block belongs to the field right below it only
    return result


def default_text(f: dataclasses.Field) -> str:
    """The field's default as --help shows it."""
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) if value else "none"
    if value == "":
        return "unset"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return str(value)


def flag_help(f: dataclasses.Field, doc: FieldHelp | None, env_var: str | None) -> str:
    """The whole --help text of one flag: what it does, its default, its variable."""
    text = f.metadata.get("help") or (doc.text if doc else "")
    suffix = f"(default: {default_text(f)})"
    if env_var:
        suffix += f" [env {env_var}]"
    text = f"{text.rstrip('.')}. {suffix}" if text else suffix
    return text.replace("%", "%%")  # argparse %-formats help strings
