"""JSON files the services read at start (grid configs, worker profiles, model configs)."""
from __future__ import annotations

import json
import os
from typing import Any

from tandem.errors import InvalidRequest


def read_json_file(path: str | os.PathLike[str], what: str, param: str | None = None) -> Any:
    """The JSON document in `path`.

    Raises:
        OSError: the file cannot be read.
        InvalidRequest: it is not JSON; the message names `what` (e.g. "grid config"), the
            file and where the JSON breaks.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{what} {os.fspath(path)} is not valid JSON: {e.msg} (line "
                             f"{e.lineno}, column {e.colno})", param=param) from None
