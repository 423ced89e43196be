"""`tandem up` keeps its services running, as compose's `restart:` and Kubernetes do: a process
that exits while the topology runs is started again after a back-off, with a log line naming its
exit status, and its restart count goes into a state file that `tandem status` shows. A worker
its planner adds is supervised from its start; one it removes is retired first, so that its exit
is not taken for a failure."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
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
    #: running, restarting (waiting out its back-off), or draining (retired: finishing its
    #: work before it exits for good)
    state: str = "running"
    restarts: int = 0
    #: How it last exited ("" if it never did), and when (Unix seconds; 0: never).
    last_exit: str = ""
    last_exit_at: float = 0.0


async def wait_exit(child: subprocess.Popen[bytes]) -> int:
    """The child's exit code, once it exits. One thread per wait (Popen.wait blocks), not a
    pool's: a pool sized for the children at start would leave those added later waiting."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def report(code: int) -> None:
        if not done.done():
            done.set_result(code)

    def wait() -> None:
        code = child.wait()
        with contextlib.suppress(RuntimeError):  # the launcher's loop closed meanwhile
            loop.call_soon_threadsafe(report, code)

    threading.Thread(target=wait, name=f"tandem-up-wait-{child.pid}", daemon=True).start()
    return await done


class Supervisor:
    """Waits on every child and restarts those that exit, but for those it was told to retire.

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
        #: Children told to go for good (tandem.launcher.scaling): never restarted.
        self._retired: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._write()
        self._tasks = [asyncio.create_task(self._watch(name)) for name in self.children]

    def watch(self, name: str) -> None:
        """Supervises child `name`, started after `start` (a worker a planner added)."""
        self.states[name] = ServiceState(name, self.children[name].pid)
        self._write()
        self._tasks.append(asyncio.create_task(self._watch(name)))

    def retire(self, name: str) -> None:
        """Child `name` is about to be stopped on purpose: its exit is not restarted, and it
        leaves the state file once it exited. Call before signalling it."""
        self._retired.add(name)
        state = self.states.get(name)
        if state is not None and state.state == "exited":  # not watched any more
            self._forget(name)
        elif state is not None:
            state.state = "draining"
            self._write()

    def _forget(self, name: str) -> None:
        self.states.pop(name, None)
        self._retired.discard(name)
        self._write()

    async def _watch(self, name: str) -> None:
        attempt = 0
        while True:
            child = self.children[name]
            started = time.monotonic()
            code = await wait_exit(child)
            if self.is_stopping:
                return
            if name in self._retired:
                self._forget(name)
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
            if name in self._retired:  # retired while it waited out its back-off
                self._forget(name)
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
