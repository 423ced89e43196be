"""Several frontend processes: what `tandem up --frontend-processes N` starts (names, shared and
own ports, metrics ports) and in which order it stops them, and the command lines
`tandem serve frontend --processes N` gives its children."""
from __future__ import annotations

import asyncio
import pathlib
import sys
import time

import pytest

from services.frontend.config import FrontendConfig
from services.frontend.supervisor import child_argv
from tandem.errors import InvalidRequest
from tandem.launcher.deployment import Deployment
from tandem.launcher.processes import processes
from tandem.launcher.topology import Topology
from tandem.launcher.workers import ServiceProcess
from tandem.runtime import config as config_lib
from tandem.runtime import cores as cores_module
from tandem.runtime.tls import TlsConfig


def frontend_config(argv: list[str]) -> FrontendConfig:
    return config_lib.load(FrontendConfig, argv[argv.index("frontend") + 1:], prog="t",
                           environ={})


def test_one_process_keeps_the_name_and_ports(tmp_path: pathlib.Path) -> None:
    (frontend,) = [p for p in processes(Deployment(engine="mock", frontend_metrics_port=9400),
                                        tmp_path) if p.name.startswith("frontend")]
    config = frontend_config(frontend.argv)
    assert frontend.name == "frontend" and frontend.health_address == "127.0.0.1:8001"
    assert (config.processes, config.reuse_port, config.own_grpc_port) == (1, False, 0)
    assert config.metrics_port == 9400


def test_several_share_the_ports_and_own_one_each(tmp_path: pathlib.Path) -> None:
    d = Deployment(engine="mock", frontend_processes=3, frontend_metrics_port=9400)
    specs = processes(d, tmp_path)
    assert [p.name for p in specs] == ["decode-0", "router", "frontend-0", "frontend-1",
                                       "frontend-2"]
    frontends = specs[2:]
    configs = [frontend_config(p.argv) for p in frontends]
    assert all(c.reuse_port and c.processes == 1 for c in configs)
    assert {(c.http_port, c.grpc_port) for c in configs} == {(8000, 8001)}
    assert [c.metrics_port for c in configs] == [9400, 9401, 9402]
    own = [c.own_grpc_port for c in configs]
    assert len(set(own)) == 3 and 8001 not in own
    assert [p.health_address for p in frontends] == [f"127.0.0.1:{port}" for port in own]
    assert {p.stop_group for p in frontends} == {"frontend"}


def test_own_ports_avoid_the_ports_planned_for_other_services(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router and workers bind their ports only once started: a frontend's own port, taken
    from the kernel before that, must not be one of theirs (a flake that once failed
    `tandem up` with "Address already in use" on the router's port)."""
    import socket

    from tandem.launcher import processes as processes_module

    offered = iter([9100, 8001, 9200, 41000, 41001])  # router, grpc, worker, then free ones

    class Socket(socket.socket):
        def bind(self, address: object) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes_module.socket, "socket", Socket)
    d = Deployment(engine="mock", frontend_processes=2)
    own = [frontend_config(p.argv).own_grpc_port for p in processes(d, tmp_path)
           if p.name.startswith("frontend")]
    assert own == [41000, 41001]


def test_negative_processes_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidRequest, match="frontend_processes"):
        processes(Deployment(engine="mock", frontend_processes=-1), tmp_path)


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4),
                                                 (64, 4)])
def test_zero_processes_means_one_per_four_cores(tmp_path: pathlib.Path,
                                                 monkeypatch: pytest.MonkeyPatch, cores: int,
                                                 expected: int) -> None:
    monkeypatch.setattr(cores_module.os, "sched_getaffinity", lambda pid: set(range(cores)))
    frontends = [p for p in processes(Deployment(engine="mock"), tmp_path)
                 if p.name.startswith("frontend")]
    assert len(frontends) == expected
    assert [p.name for p in frontends] == (
        ["frontend"] if expected == 1 else [f"frontend-{i}" for i in range(expected)])


def test_supervisor_children_override_processes_and_take_their_own_ports() -> None:
    argv = ["--http-port", "8000", "--metrics-port", "9400", "--own-grpc-port", "9500",
            "--processes", "2"]
    config = config_lib.load(FrontendConfig, argv, prog="t", environ={})
    children = [frontend_config(child_argv(config, argv, i)) for i in range(2)]
    assert [(c.processes, c.reuse_port, c.http_port) for c in children] == [(1, True, 8000)] * 2
    assert [c.metrics_port for c in children] == [9400, 9401]
    assert [c.own_grpc_port for c in children] == [9500, 9501]


#: A stand-in service: on SIGTERM it logs that, drains for a moment, logs its exit.
_SERVICE = """
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
name = sys.argv[2]
def term(*_):
    log.write(f"term {name}\\n"); time.sleep(0.3); log.write(f"exit {name}\\n"); sys.exit(0)
signal.signal(signal.SIGTERM, term)
log.write(f"up {name}\\n")
while True:
    time.sleep(1)
"""


def test_frontends_drain_together_before_the_router(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "log"
    names = ["decode-0", "router", "frontend-0", "frontend-1"]
    specs = [ServiceProcess(name, "", [sys.executable, "-c", _SERVICE, str(log), name],
                            stop_group="frontend" if name.startswith("frontend") else "")
             for name in names]
    topology = Topology(specs, TlsConfig())
    topology.start()
    deadline = time.monotonic() + 30
    while len(log.read_text().splitlines() if log.exists() else []) < len(names):
        assert time.monotonic() < deadline, "the stand-in services did not start"
        time.sleep(0.05)  # until each child says it is up (its SIGTERM handler is set)
    asyncio.run(topology.stop(grace_s=5))
    events = [line for line in log.read_text().splitlines() if not line.startswith("up ")]
    # Both frontends were told before either finished draining; the router only after both.
    assert sorted(events[:2]) == ["term frontend-0", "term frontend-1"]
    assert sorted(events[2:4]) == ["exit frontend-0", "exit frontend-1"]
    assert events[4:] == ["term router", "exit router", "term decode-0", "exit decode-0"]
