"""`tandem up`: start a whole topology as local processes, wait until every service reports
SERVING on its gRPC health service, print where to reach it, stop everything on SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from tandem.launcher.deployment import Deployment, ServiceProcess, processes, with_model
from tandem.model.demo import ensure_demo_model
from tandem.runtime import config as config_lib
from tandem.runtime import logs
from tandem.runtime.health_probe import wait_serving
from tandem.runtime.tls import TlsConfig

log = logging.getLogger("tandem.up")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A child must not outlive the launcher, even if the launcher is killed with SIGKILL.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def _wait_serving(address: str, child: subprocess.Popen[bytes], tls: TlsConfig) -> None:
    """Returns when the service at `address` reports SERVING; raises if its process exits."""
    if not await wait_serving(address, lambda: child.poll() is None, tls=tls):
        raise RuntimeError(f"{address} exited with code {child.returncode} before it was ready")


class Topology:
    def __init__(self, specs: list[ServiceProcess], tls: TlsConfig) -> None:
        self.specs = specs
        #: The services' TLS config: the launcher's health probes speak it too.
        self.tls = tls
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for spec in self.specs:
            # Own session: a Ctrl-C on the terminal reaches only the launcher, which then stops
            # the children in order (frontend first) instead of all at once.
            self.children[spec.name] = subprocess.Popen(spec.argv, env=env,
                                                        start_new_session=True,
                                                        preexec_fn=_die_with_parent)
            log.info("started", extra={"service": spec.name, "pid": self.children[spec.name].pid})

    async def wait_ready(self) -> None:
        await asyncio.gather(*(_wait_serving(s.health_address, self.children[s.name], self.tls)
                               for s in self.specs))

    async def stop(self, grace_s: float) -> None:
        """SIGTERM in reverse start order (frontend first, so it drains onto live workers)."""
        for spec in reversed(self.specs):
            child = self.children.get(spec.name)
            if child is None or child.poll() is not None:
                continue
            child.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(child.wait, grace_s + 5)
            except subprocess.TimeoutExpired:
                log.warning("did not drain in time; killing", extra={"service": spec.name})
                child.kill()
                await asyncio.to_thread(child.wait)


def _banner(d: Deployment, model_dir: str, name: str) -> str:
    url = f"{'https' if d.tls.enabled else 'http'}://{d.host}:{d.http_port}"
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32, "stream": True})
    return (f"READY http={url} grpc={d.host}:{d.grpc_port} model={name} "
            f"tokenizer={model_dir.rstrip('/')}/\n"
            f"Tandem is up: OpenAI API at {url}/v1, gRPC Inference API at {d.host}:{d.grpc_port}\n"
            f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}'\n"
            "Press Ctrl-C to stop.")


async def run(d: Deployment) -> int:
    model_dir = d.engine_args.model or str(ensure_demo_model())
    d = with_model(d, model_dir)
    name = d.served_model_name or pathlib.Path(model_dir).name
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-up-"))
    topology = Topology(processes(d, workdir), d.tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    topology.start()
    code = 0
    try:
        ready = asyncio.ensure_future(topology.wait_ready())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()  # raises when a service died during start-up
            print(_banner(d, model_dir, name), flush=True)
            await stopped
        else:
            ready.cancel()
    except RuntimeError as exc:
        log.error("start-up failed", extra={"error": str(exc)})
        code = 1
    finally:
        await topology.stop(d.grace_period_s)
        shutil.rmtree(workdir, ignore_errors=True)
    return code


def main(argv: Sequence[str]) -> None:
    d = config_lib.load(Deployment, argv, prog="tandem up",
                        description="Start a whole Tandem topology as local processes.")
    logs.setup("up", d.log_level)
    sys.exit(asyncio.run(run(d)))
