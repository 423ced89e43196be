"""Reading tool calls written as JSON."""
from __future__ import annotations

import json
from typing import Any


def dump_arguments(value: dict[str, Any]) -> str:
    """Arguments as OpenAI sends them: a JSON object string, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False)


def loads_object(text: str) -> dict[str, Any] | None:
    """`text` parsed as a JSON object, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) from `{"name": ..., <argument key>: {...}}`, or None if malformed.

    Arguments may be an object or a string holding a JSON object (some fine-tunes double-encode);
    a missing arguments key means no arguments.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    if isinstance(args, str):
        args = loads_object(args)
    if not isinstance(args, dict):
        return None
    return name, dump_arguments(args)
