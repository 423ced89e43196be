"""How many cores this process may use (sizing thread pools and processes to the machine)."""
from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's share), not the
    host's count where the platform says."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
