"""The launcher's half of `tandem up --planner`: a PoolScaler acting on the topology's processes,
the router's members kept in its config file, and the control API the planner calls.

Why the router learns members from its config file and SIGHUP rather than an RPC: the file is
what a restarted router reads, so it must hold the current members anyway; a signal then tells
the running routers to read it again (services.router.main), as DNS re-resolution does for a
Kubernetes pool. The frontends' local routers take the router's list every few seconds.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc
import yaml

from tandem.launcher.ports import free_port
from tandem.launcher.scaling import PoolScaler
from tandem.launcher.served_models import model_topologies, router_config
from tandem.launcher.supervisor import Supervisor
from tandem.launcher.workers import ServiceProcess
from tandem.runtime import launcher_control
from tandem.runtime.health_probe import wait_serving

if TYPE_CHECKING:
    from tandem.launcher.deployment import Deployment
    from tandem.launcher.topology import Topology

log = logging.getLogger("tandem.up")


class TopologyProcesses:
    """tandem.launcher.scaling.Processes over the topology's children and its supervisor (set
    by `open`, once the topology is ready)."""

    def __init__(self, topology: Topology, grace_s: float) -> None:
        self.topology = topology
        self.grace_s = grace_s
        self.supervisor: Supervisor | None = None
        self._stopping: set[str] = set()

    def start(self, spec: ServiceProcess) -> None:
        assert self.supervisor is not None, "scaling starts once the topology is supervised"
        self.topology.add(spec)
        self.supervisor.watch(spec.name)

    async def serving(self, spec: ServiceProcess) -> bool:
        def is_wanted() -> bool:
            return spec.name in self.topology.children and spec.name not in self._stopping

        return await wait_serving(spec.health_address, is_wanted, tls=self.topology.tls)

    async def stop(self, name: str) -> None:
        self._stopping.add(name)
        if self.supervisor is not None:
            self.supervisor.retire(name)
        await self.topology.stop_one(name, self.grace_s)
        self.topology.forget(name)
        self._stopping.discard(name)

    def pid(self, name: str) -> int:
        child = self.topology.children.get(name)
        return child.pid if child is not None and child.poll() is None else 0


class RouterMembers:
    """Writes the router's config with each pool's current workers and signals the routers."""

    def __init__(self, d: Deployment, topology: Topology, path: pathlib.Path) -> None:
        self.d = d
        self.model = model_topologies(d)[0]
        self.topology = topology
        self.path = path

    def publish(self, ports: Mapping[str, list[int]]) -> None:
        pools = [dataclasses.replace(p, ports=list(ports.get(p.name, p.ports)))
                 for p in self.model.pools]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(router_config(self.d, dataclasses.replace(
            self.model, pools=pools))))
        os.replace(tmp, self.path)  # a router restarting now reads the old or the new, whole
        for name in self.topology.router_names:
            child = self.topology.children.get(name)
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGHUP)


class LauncherControl:
    """Builds the scaler over `topology` (before it starts: the planner among its processes
    needs the API's address), serves the API, and lets the planner act once `open`."""

    def __init__(self, d: Deployment, topology: Topology, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        self.processes = TopologyProcesses(topology, d.grace_period_s)
        members = RouterMembers(d, topology, workdir / "router.yaml")
        self.scaler = PoolScaler(d, members.model, topology.specs, self.processes,
                                 members.publish, lambda: free_port(d.host))
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Serves the API; returns its address (for the planner's command line)."""
        self._server, address = await launcher_control.serve(
            self.scaler, launcher_control.control_address(str(self.workdir)))
        self.scaler.start()
        log.debug("control API serving", extra={"address": address})
        return address

    def open(self, supervisor: Supervisor) -> None:
        """The topology is ready and `supervisor` watches it: the planner may scale now."""
        self.processes.supervisor = supervisor
        self.scaler.open()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(1.0)
        await self.scaler.close()
