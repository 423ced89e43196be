"""The interpreter's thread switch interval on a serving process.

A serving process runs its event loop beside threads that run Python too: a worker's step
thread launches a step's kernels (graph replays, attention calls) with Python between calls
that release the GIL for a few microseconds each. CPython hands the GIL to a waiting thread at
once only when the holder blocks; a thread that releases and retakes it between short calls
keeps it until the waiter has asked for it for a whole switch interval (5 ms by default). So
the loop, woken by a socket, waits up to 5 ms for each turn, again and again while the other
thread runs: requests and session frames are read in clusters (issue 25: a 64-request burst
reached a decode worker's loop in clusters 8-9 ms apart on the H100 host, benchmarks/RESULTS.md,
round 8). `benchmarks/probes/gil_handoff.py` shows the mechanism: on the 2-core development VM, with
~17 us of Python between a thread's GIL releases, a loop's wake-ups waited p99 5.9 ms at 5 ms,
5.3 ms at 1 ms and 3.1 ms at 0.2 ms. Every service process sets TANDEM_SWITCH_INTERVAL_MS
before it serves, where that is shorter than Python's; unset (or 0), Python's 5 ms stays: the
served effect on the GPU is not measured yet (a shorter interval also means more forced
switches between busy threads).
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

#: The interval every service process uses, in milliseconds; 0: Python's own.
DEFAULT_MS = 0.0
ENV = "TANDEM_SWITCH_INTERVAL_MS"


def configured_ms() -> float:
    """TANDEM_SWITCH_INTERVAL_MS, else DEFAULT_MS; 0 or less: Python's own."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_MS
    try:
        return float(text)
    except ValueError:
        log.warning("ignoring a malformed switch interval", extra={"env": ENV, "value": text})
        return DEFAULT_MS


def shorten_switch_interval(ms: float | None = None) -> float:
    """Sets the interpreter's switch interval to `ms` (configured_ms() when None) where that is
    shorter than the current one; returns the interval in effect, in milliseconds."""
    ms = configured_ms() if ms is None else ms
    if 0 < ms < 1000 * sys.getswitchinterval():
        sys.setswitchinterval(ms / 1000)
    return 1000 * sys.getswitchinterval()
