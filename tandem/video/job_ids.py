"""Public video ids: the worker's job id and the worker's address in one opaque token, so that
any frontend process (or replica) can find a job after a client reconnects, with no shared job
store. An id only leads to an address the router lists in a video pool (the frontend checks
before it connects), so a forged id cannot point the frontend anywhere else."""
from __future__ import annotations

import base64
import binascii
import re

from tandem.video.jobs import JobNotFound

_PUBLIC = re.compile(r"video_([0-9a-f]{32})([a-z2-7]+)")
_ADDRESS = re.compile(r"[\w.\-\[\]:]+:\d{1,5}")


def encode(address: str, job_id: str) -> str:
    token = base64.b32encode(address.encode()).decode().lower().rstrip("=")
    return f"video_{job_id}{token}"


def decode(public_id: str) -> tuple[str, str]:
    """(worker address, job id).

    Raises:
        JobNotFound: not an id this API gave out.
    """
    match = _PUBLIC.fullmatch(public_id)
    if match is not None:
        token = match[2].upper()
        try:
            address = base64.b32decode(token + "=" * (-len(token) % 8)).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            address = ""
        if _ADDRESS.fullmatch(address):
            return address, match[1]
    raise JobNotFound(f"no video '{public_id}'", param="video_id")
