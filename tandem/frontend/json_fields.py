"""Typed getters for fields of a decoded JSON request body, shared by the request parsers.

Each getter returns None when the key is absent or JSON null, and raises InvalidRequest naming
the field (`param`, default: the key) when the value has the wrong type or is out of range.
Booleans are never accepted where a number is expected.
"""
from __future__ import annotations

import math
from typing import Any

from tandem.errors import InvalidRequest


def get_int(obj: dict[str, Any], key: str, param: str | None = None, *,
            lo: int | None = None, hi: int | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    param = param or key
    if not is_int(value):
        raise must(param, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidRequest(f"'{param}' must be {_range(lo, hi)}, got {value}", param=param)
    return value  # type: ignore[no-any-return]


def get_float(obj: dict[str, Any], key: str, param: str | None = None, *,
              lo: float | None = None, hi: float | None = None,
              lo_open: bool = False) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    param = param or key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise must(param, "a number", value)
    x = float(value)
    low_bad = lo is not None and (x <= lo if lo_open else x < lo)
    if not math.isfinite(x) or low_bad or (hi is not None and x > hi):
        raise InvalidRequest(f"'{param}' must be {_range(lo, hi, lo_open)}, got {x}", param=param)
    return x


def get_bool(obj: dict[str, Any], key: str, param: str | None = None) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise must(param or key, "a boolean", value)


def get_str(obj: dict[str, Any], key: str, param: str | None = None, *,
            non_empty: bool = False) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or (non_empty and not value):
        raise must(param or key, "a non-empty string" if non_empty else "a string", value)
    return value


def get_object(obj: dict[str, Any], key: str, param: str | None = None) -> dict[str, Any]:
    """The object at `key`; {} when absent or null."""
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise must(param or key, "an object", value)
    return value


def must(param: str, what: str, value: object) -> InvalidRequest:
    """The error for a field of the wrong JSON type."""
    return InvalidRequest(f"'{param}' must be {what}, got {json_type(value)}", param=param)


def first(*values: Any) -> Any:
    """The first value that is not None (None when all are)."""
    for value in values:
        if value is not None:
            return value
    return None


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    low = f"{'>' if lo_open else '>='} {_num(lo)}" if lo is not None else ""
    high = f"<= {_num(hi)}" if hi is not None else ""
    return " and ".join(part for part in (low, high) if part)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number",
               str: "string", list: "array", dict: "object"}


def json_type(value: object) -> str:
    """The JSON name of `value`'s type, for error messages."""
    return _JSON_TYPES.get(type(value), type(value).__name__)
