"""`tandem up`: start a whole topology as local processes, wait until every service reports
SERVING on its gRPC health service and the router takes every worker as a routing candidate,
print where to reach it, stop everything on SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence

from tandem.errors import TandemError
from tandem.launcher import planner_process
from tandem.launcher.control import LauncherControl
from tandem.launcher.deployment import Deployment, with_model
from tandem.launcher.processes import processes
from tandem.launcher.served_models import model_topologies
from tandem.launcher.supervisor import Supervisor, state_path
from tandem.launcher.topology import StartupFailed, Topology
from tandem.launcher.workers import ServiceProcess, video_model_name
from tandem.model.demo import ensure_demo_model
from tandem.runtime import config as config_lib
from tandem.runtime import logs, unix_sockets

log = logging.getLogger("tandem.up")


def _banner(d: Deployment, model_dir: str, name: str) -> str:
    url = f"{'https' if d.tls.enabled else 'http'}://{d.host}:{d.http_port}"
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32, "stream": True})
    return (f"READY http={url} grpc={d.host}:{d.grpc_port} model={name} "
            f"tokenizer={model_dir.rstrip('/')}/\n"
            f"Tandem is up: OpenAI API at {url}/v1, gRPC Inference API at {d.host}:{d.grpc_port}\n"
            f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}'\n" + _video_banner(d, url) +
            "Press Ctrl-C to stop.")


def _video_banner(d: Deployment, url: str) -> str:
    if not d.video_ports:
        return ""
    body = json.dumps({"model": video_model_name(d), "prompt": "a red fox in the snow",
                       "size": "320x192", "num_frames": 9, "num_inference_steps": 4,
                       "response_format": "url"})
    return (f"  curl {url}/v1/videos -H 'Content-Type: application/json' -d '{body}'\n")


def _unix_socket_dir(d: Deployment, workdir: pathlib.Path) -> pathlib.Path | None:
    """The children's socket directory, inside the run's private work directory (removed at
    exit); None: they talk TCP (--no-unix-sockets, TLS, or a path too long for a socket)."""
    if not d.unix_sockets or d.tls.enabled:
        return None
    path = workdir / "sockets"
    if not unix_sockets.fits(str(path)):
        log.warning("the work directory's path is too long for Unix sockets; using TCP",
                    extra={"path": str(path)})
        return None
    path.mkdir(mode=0o700)
    return path


def _warn_of_visible_devices(specs: Sequence[ServiceProcess]) -> None:
    """GPU entries are host indices: a CUDA_VISIBLE_DEVICES the launcher runs under does not
    renumber them, and placed workers do not inherit it. Say so, since that may surprise."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    placed = [s.name for s in specs if "CUDA_VISIBLE_DEVICES" in s.env]
    if inherited is not None and placed:
        log.warning("placed workers see the GPUs their entries name, as the host numbers "
                    "them, instead of the launcher's CUDA_VISIBLE_DEVICES",
                    extra={"launcher_cuda_visible_devices": inherited, "placed": placed})


async def run(d: Deployment) -> int:
    if d.models:  # the banner names the first
        model_dir, name = d.models[0].model or str(ensure_demo_model()), d.models[0].name
    else:
        model_dir = d.engine_args.model or str(ensure_demo_model())
        d = with_model(d, model_dir)
        name = d.served_model_name or pathlib.Path(model_dir).name
    plan = None
    if d.planner:  # checked before anything starts
        d, plan = planner_process.prepare(d)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tandem-up-"))
    routers = [name for t in model_topologies(d) for name in t.routers]
    specs = processes(d, workdir)
    _warn_of_visible_devices(specs)
    topology = Topology(specs, d.tls, workdir, routers, _unix_socket_dir(d, workdir))
    control: LauncherControl | None = None
    launcher: dict[str, object] = {"launcher_pid": os.getpid(),
                                   "router": f"{d.host}:{d.router_port}",
                                   "restart_policy": d.restart_policy}
    if plan is not None:
        # The planner is started last and so stopped first: nothing resizes a topology that
        # is going down.
        try:
            control = LauncherControl(d, topology, workdir)  # checks the pools' spare_gpus
        except TandemError:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        topology.specs.append(planner_process.planner_process(d, plan, workdir,
                                                              await control.start()))
        launcher["planner_status"] = str(planner_process.status_path(workdir))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    topology.start()
    failure: StartupFailed | None = None
    supervisor: Supervisor | None = None
    try:
        ready = asyncio.ensure_future(topology.wait_ready())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()  # raises when a service died during start-up
            # From here on a service that exits is restarted (a start-up failure is final).
            supervisor = Supervisor(topology.children, topology.restart, d.restart_policy,
                                    state_path(d.router_port), launcher)
            supervisor.start()
            if control is not None:
                control.open(supervisor)
            print(_banner(d, model_dir, name), flush=True)
            await stopped
        else:
            ready.cancel()
    except StartupFailed as exc:
        failure = exc
    finally:
        if supervisor is not None:
            await supervisor.stop()
        if control is not None:
            await control.close()
        await topology.stop(d.grace_period_s)
        shutil.rmtree(workdir, ignore_errors=True)
    if failure is not None:
        # The child said why in its own log already; this is the line a person reads last.
        print(f"tandem up: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Sequence[str]) -> None:
    d = config_lib.load(Deployment, argv, prog="tandem up",
                        description="Start a whole Tandem topology as local processes.")
    logs.setup("up", d.log_level, d.log_format)
    sys.exit(asyncio.run(run(d)))
