"""The processes of a `tandem up` topology: started in order, waited on until every service
serves and the routers take every worker, restarted, added and stopped (frontend first)."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Sequence

from tandem.errors import TandemError
from tandem.launcher.workers import ServiceProcess
from tandem.routing.snapshot import all_candidates, not_candidates
from tandem.runtime import unix_sockets
from tandem.runtime.children import die_with_parent
from tandem.runtime.health_probe import wait_serving
from tandem.runtime.router_status import RouterStatusClient
from tandem.runtime.termination_log import TERMINATION_LOG_ENV
from tandem.runtime.tls import TlsConfig

log = logging.getLogger("tandem.up")
#: Between two ListWorkers calls while the router takes the workers on (it reconnects to a
#: worker within its back-off, at most 2 s), and between two log lines naming the missing ones.
CANDIDATES_POLL_S = 0.1
CANDIDATES_LOG_S = 5.0


class StartupFailed(RuntimeError):
    """A service exited before the topology was ready; the message says which and why."""


class Topology:
    def __init__(self, specs: list[ServiceProcess], tls: TlsConfig,
                 workdir: pathlib.Path | None = None,
                 router_names: Sequence[str] = ("router",),
                 unix_socket_dir: pathlib.Path | None = None) -> None:
        self.specs = specs
        #: The router processes (each must take every worker before the topology is ready).
        self.router_names = tuple(router_names)
        #: The services' TLS config: the launcher's health probes speak it too.
        self.tls = tls
        #: Where each child writes the line that says why it failed (its termination log).
        self.workdir = workdir
        #: The children's Unix-domain sockets (tandem.runtime.unix_sockets); None: TCP only.
        self.unix_socket_dir = unix_socket_dir
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def _termination_log(self, name: str) -> pathlib.Path | None:
        return self.workdir / f"{name}.exit" if self.workdir is not None else None

    def start(self) -> None:
        for spec in self.specs:
            self._spawn(spec)

    def _spawn(self, spec: ServiceProcess) -> subprocess.Popen[bytes]:
        # A placed worker's CUDA_VISIBLE_DEVICES replaces the launcher's (spec.env).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        if (path := self._termination_log(spec.name)) is not None:
            env[TERMINATION_LOG_ENV] = str(path)
        env.pop(unix_sockets.SOCKET_DIR_ENV, None)  # not a directory of another run's
        if self.unix_socket_dir is not None:
            env[unix_sockets.SOCKET_DIR_ENV] = str(self.unix_socket_dir)
            parts = unix_sockets.split_address(spec.health_address)
            if spec.is_dialed_by_peers and parts is not None:
                unix_sockets.reserve(str(self.unix_socket_dir), parts[1])
        # Own session: a Ctrl-C on the terminal reaches only the launcher, which then stops
        # the children in order (frontend first) instead of all at once.
        child = self.children[spec.name] = subprocess.Popen(spec.argv, env=env,
                                                            start_new_session=True,
                                                            preexec_fn=_child_setup)
        log.debug("started", extra={"service": spec.name, "pid": child.pid})
        return child

    def restart(self, name: str) -> subprocess.Popen[bytes]:
        """Starts service `name` again, with the command line it first had."""
        return self._spawn(next(s for s in self.specs if s.name == name))

    def add(self, spec: ServiceProcess) -> None:
        """Starts a worker added while the topology runs, placed in the start order with the
        workers (before the routers): `stop` then drains it after the frontends."""
        first_router = next((i for i, s in enumerate(self.specs)
                             if s.name in self.router_names), len(self.specs))
        self.specs.insert(first_router, spec)
        self._spawn(spec)

    def forget(self, name: str) -> None:
        """Drops a service that exited for good (a worker the planner removed)."""
        self.specs = [s for s in self.specs if s.name != name]
        self.children.pop(name, None)

    def failure(self, name: str) -> StartupFailed:
        """Why child `name` exited: the line it wrote to its termination log, else its code."""
        code = self.children[name].returncode
        path = self._termination_log(name)
        reason = ""
        if path is not None and path.is_file():
            reason = " ".join(path.read_text(errors="replace").split())
        return StartupFailed(f"{name} did not start: {reason}" if reason else
                             f"{name} exited with code {code} before it was ready (its log "
                             "above says more)")

    async def _wait_serving(self, spec: ServiceProcess) -> None:
        """Returns when `spec`'s service reports SERVING; raises if its process exits."""
        child = self.children[spec.name]
        if not await wait_serving(spec.health_address, lambda: child.poll() is None,
                                  tls=self.tls):
            raise self.failure(spec.name)

    async def wait_ready(self) -> None:
        await asyncio.gather(*(self._wait_serving(s) for s in self.specs))
        await self._wait_candidates()

    def _check_alive(self) -> None:
        for name, child in self.children.items():
            if child.poll() is not None:
                raise self.failure(name)

    async def _wait_candidates(self) -> None:
        """Returns when the router takes every worker of every pool as a routing candidate: the
        router serves as soon as one can take a request, and a worker it has not taken yet
        would get no traffic. Raises if a process exits first."""
        routers = [s.health_address for s in self.specs if s.name in self.router_names]
        await asyncio.gather(*(self._wait_router_candidates(router) for router in routers))

    async def _wait_router_candidates(self, router: str) -> None:
        logged_at = time.monotonic()
        async with RouterStatusClient(router, self.tls) as client:
            while True:
                self._check_alive()
                failure = ""
                try:
                    pools = await client.list_workers()
                except TandemError as exc:  # the next round says whether the router exited
                    pools, failure = [], exc.message
                if all_candidates(pools):
                    return
                if time.monotonic() - logged_at >= CANDIDATES_LOG_S:
                    logged_at = time.monotonic()
                    log.info("waiting for the router to take workers as candidates", extra={
                        "workers": {w.worker_id: w.reason for _, w in not_candidates(pools)},
                        "router_error": failure})
                await asyncio.sleep(CANDIDATES_POLL_S)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM in reverse start order (frontend first, so it drains onto live workers); the
        processes of one stop group (the frontend processes) drain together."""
        groups: list[list[ServiceProcess]] = []
        for spec in reversed(self.specs):
            if groups and spec.stop_group and groups[-1][0].stop_group == spec.stop_group:
                groups[-1].append(spec)
            else:
                groups.append([spec])
        for group in groups:
            await asyncio.gather(*(self.stop_one(spec.name, grace_s) for spec in group))

    async def stop_one(self, name: str, grace_s: float) -> None:
        """SIGTERM to `name`; returns once it exited (killed `grace_s` + 5 s later)."""
        child = self.children.get(name)
        if child is None or child.poll() is not None:
            return
        child.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(child.wait, grace_s + 5)
        except subprocess.TimeoutExpired:
            log.warning("did not drain in time; killing", extra={"service": name})
            child.kill()
            await asyncio.to_thread(child.wait)


def _child_setup() -> None:
    """In each child before it runs: dies with the launcher, and ignores SIGHUP until it sets
    its own handler (a router re-reads its config on SIGHUP, which by default would kill one
    signalled while it starts)."""
    die_with_parent()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
