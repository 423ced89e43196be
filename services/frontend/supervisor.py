"""`tandem serve frontend --processes N`: N frontend processes behind the same ports, for one
container (a compose service, a Kubernetes pod) that should use several cores.

Each child is an ordinary `tandem serve frontend` with --reuse-port (SO_REUSEPORT on the HTTP and
gRPC ports: the kernel spreads new connections over the processes listening), and its own
--metrics-port (and --own-grpc-port) when those are set: the supervisor's value plus the child's
index, so that a scraper can reach each process. The supervisor serves nothing and restarts
nothing: on SIGTERM/SIGINT it passes the signal on and waits for every child to drain; when a
child exits on its own it stops the others and exits 1, so that the container's restart policy
takes over (a half-sized frontend would hide the failure).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from services.frontend.config import FrontendConfig
from tandem.runtime import logs
from tandem.runtime.children import die_with_parent

log = logging.getLogger(__name__)


def child_argv(config: FrontendConfig, argv: Sequence[str], index: int) -> list[str]:
    """The command line of child `index`: the supervisor's own flags, then the overrides (a
    later flag wins)."""
    overrides = ["--processes", "1", "--reuse-port"]
    if config.metrics_port:
        overrides += ["--metrics-port", str(config.metrics_port + index)]
    if config.own_grpc_port:
        overrides += ["--own-grpc-port", str(config.own_grpc_port + index)]
    return [sys.executable, "-m", "tandem.cli", "serve", "frontend", *argv, *overrides]


async def _supervise(config: FrontendConfig, argv: Sequence[str]) -> int:
    children = [await asyncio.create_subprocess_exec(*child_argv(config, argv, i),
                                                     preexec_fn=die_with_parent)
                for i in range(config.processes)]
    log.info("frontend processes started", extra={"pids": [c.pid for c in children]})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    exits = {asyncio.ensure_future(c.wait()): i for i, c in enumerate(children)}
    stopping = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([*exits, stopping], return_when=asyncio.FIRST_COMPLETED)
    died = sorted(exits[task] for task in done if task in exits)
    for child in children:
        if child.returncode is None:
            child.send_signal(signal.SIGTERM)
    codes = await asyncio.gather(*(c.wait() for c in children))
    stopping.cancel()
    if died:
        log.error("a frontend process exited; stopped the others", extra={
            "process": died[0], "pid": children[died[0]].pid, "code": codes[died[0]]})
        return 1
    log.info("frontend processes stopped", extra={"codes": codes})
    return 0 if not any(codes) else 1


def supervise(config: FrontendConfig, argv: Sequence[str]) -> int:
    """Runs `config.processes` frontend children until SIGTERM or until one exits; the exit
    code: 0 after a clean stop of all, 1 otherwise."""
    logs.setup("frontend", config.log_level, config.log_format, instance="supervisor")
    return asyncio.run(_supervise(config, argv))
