"""`tandem up` stops every child it started: on SIGTERM after a drain, and even when the
launcher itself is killed (children die with their parent)."""
from __future__ import annotations

import os
import pathlib
import select
import signal
import time

import pytest

from tests.e2e.topology import start_topology


def children_of(pid: int) -> list[int]:
    tasks = pathlib.Path(f"/proc/{pid}/task")
    found: list[int] = []
    for task in tasks.iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def wait_gone(pids: list[int], timeout_s: float = 30) -> list[int]:
    """Pids still running after `timeout_s`; exit is observed through pidfds, not polling."""
    fds = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
    try:
        deadline = time.monotonic() + timeout_s
        pending = dict(fds)
        while pending and time.monotonic() < deadline:
            ready, _, _ = select.select(list(pending.values()), [], [],
                                        deadline - time.monotonic())
            pending = {p: fd for p, fd in pending.items() if fd not in ready}
        return sorted(pending)
    finally:
        for fd in fds.values():
            os.close(fd)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_no_orphans(how: str) -> None:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0")
    children = children_of(topo.process.pid)
    assert len(children) == 3  # decode, router, frontend
    if how == "sigterm":
        assert topo.stop() == 0
    else:
        os.kill(topo.process.pid, signal.SIGKILL)
        topo.process.wait(timeout=10)
    assert wait_gone(children) == []
