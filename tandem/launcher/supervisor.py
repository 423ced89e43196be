"""`tandem up` keeps its services running, as compose's `restart:` and Kubernetes do: a process
that exits while the topology runs is started again after a back-off, with a log line naming its
exit status, and its restart count goes into a state file that `tandem status` shows."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

log = logging.getLogger("tandem.up")
RESTART_POLICIES = ("on-failure", "no")
#: Waits before a restart, seconds: doubled after each quick exit, back to the first once a
#: process has run `STABLE_S`.
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0


def state_path(router_port: int) -> pathlib.Path:
    """Where `tandem up` with this router port writes its services' state (`tandem status`
    reads it on the same machine)."""
    return pathlib.Path(tempfile.gettempdir()) / f"tandem-up-{router_port}.json"


def exit_status(code: int) -> str:
    """A Popen return code for people: "exit code 1", "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class ServiceState:
    name: str
    pid: int
    #: running, or restarting (waiting out its back-off)
    state: str = "running"
    restarts: int = 0
    #: How it last exited ("" if it never did), and when (Unix seconds; 0: never).
    last_exit: str = ""
    last_exit_at: float = 0.0


class Supervisor:
    """Waits on every child (one thread each: Popen.wait blocks) and restarts those that exit.

    Args:
        children: name -> the running process; `restart(name)` replaces the entry.
        restart: starts service `name` again and returns its new process.
        policy: "on-failure" (any exit while the topology runs: a service never exits on its
            own with success) or "no" (log the exit, restart nothing).
    """

    def __init__(self, children: dict[str, subprocess.Popen[bytes]],
                 restart: Callable[[str], subprocess.Popen[bytes]], policy: str,
                 path: pathlib.Path | None, launcher: dict[str, object]) -> None:
        self.children = children
        self._restart = restart
        self.policy = policy
        self.path = path
        self.launcher = launcher
        self.states = {name: ServiceState(name, child.pid) for name, child in children.items()}
        self.is_stopping = False
        self._threads = ThreadPoolExecutor(max_workers=len(children),
                                           thread_name_prefix="tandem-up-wait")
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._write()
        self._tasks = [asyncio.create_task(self._watch(name)) for name in self.children]

    async def _watch(self, name: str) -> None:
        attempt = 0
        loop = asyncio.get_running_loop()
        while True:
            child = self.children[name]
            started = time.monotonic()
            code = await loop.run_in_executor(self._threads, child.wait)
            if self.is_stopping:
                return
            state = self.states[name]
            state.last_exit, state.last_exit_at = exit_status(code), time.time()
            if self.policy == "no":
                state.state = "exited"
                log.error("service exited; not restarting it (--restart-policy no)",
                          extra={"service": name, "status": state.last_exit})
                self._write()
                return
            if time.monotonic() - started >= STABLE_S:
                attempt = 0
            delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
            attempt += 1
            state.state = "restarting"
            log.warning("service exited unexpectedly; restarting it", extra={
                "service": name, "status": state.last_exit, "restart_in_s": delay,
                "restarts": state.restarts})
            self._write()
            await asyncio.sleep(delay)
            if self.is_stopping:
                return
            new = self._restart(name)
            state.pid, state.state, state.restarts = new.pid, "running", state.restarts + 1
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        body = {**self.launcher, "services": [asdict(s) for s in self.states.values()]}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2))
        os.replace(tmp, self.path)

    async def stop(self) -> None:
        """Restarts nothing from now on (call before stopping the children)."""
        self.is_stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def read_state(path: pathlib.Path) -> dict[str, object] | None:
    """The state a running `tandem up` wrote; None when none runs with that file."""
    try:
        body = json.loads(path.read_text())
        os.kill(int(body["launcher_pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return body if isinstance(body, dict) else None
