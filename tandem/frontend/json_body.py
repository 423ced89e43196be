"""Client JSON, decoded at the boundary: malformed text and nesting deeper than any request
needs are an InvalidRequest naming what is wrong, never a RecursionError (a 500) in the decoder
or in the code that walks the value afterwards (schemas, tools, grammars)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tandem.errors import InvalidRequest

#: Deepest nesting of arrays and objects a request may carry. A JSON schema for structured
#: outputs nests a few levels per object in it; 64 leaves room for any real one and keeps every
#: recursive walk over the value far from Python's recursion limit.
MAX_JSON_DEPTH = 64


def loads(text: str | bytes, what: str = "request body", param: str | None = None) -> Any:
    """Decodes `text`.

    Raises:
        InvalidRequest: not JSON (or not UTF-8), or nested deeper than MAX_JSON_DEPTH.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        value = None  # deeper than the decoder goes: far deeper than the limit
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}", param=param) from None
    else:
        if depth_within(value, MAX_JSON_DEPTH):
            return value
    raise InvalidRequest(f"{what} nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                         param=param)


def depth_within(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and dicts at most `limit` deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True
