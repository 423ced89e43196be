"""The planner process of `tandem up --planner`: its plan checked against the deployment before
anything starts, the metrics pages it reads (ports given to the frontend and router when the
deployment sets none), its command line, and where it keeps its status for `tandem status`."""
from __future__ import annotations

import dataclasses
import pathlib

import yaml

from tandem.errors import InvalidRequest
from tandem.launcher.deployment import Deployment
from tandem.launcher.pool_view import SCALABLE_KINDS
from tandem.launcher.ports import consecutive_free_ports, free_port
from tandem.launcher.processes import auto_frontend_processes
from tandem.launcher.served_models import ModelTopology, model_topologies
from tandem.launcher.workers import ServiceProcess, serve_argv
from tandem.planner.config import PlannerConfig, read_planner_config
from tandem.planner.service_config import load_models
from tandem.runtime import config as config_lib

PLANNER = "planner"
#: The planner's role -> the kinds of deployment pool it can size, and whether the model must
#: be disaggregated (have a prefill pool) for it: a decode pool of an aggregated deployment
#: prefills too, so it is an agg pool to the planner.
_ROLE_KINDS = {"prefill": (("prefill",), True), "decode": (("decode",), True),
               "agg": (("decode", "agg"), False)}


def status_path(workdir: pathlib.Path) -> pathlib.Path:
    """Where the planner of the launcher of `workdir` writes its status (its JSON report)."""
    return workdir / "planner-status.json"


def prepare(d: Deployment) -> tuple[Deployment, PlannerConfig]:
    """The plan, read and checked against `d` with each pool's profile, and `d` with the
    router's and frontends' metrics ports set (free ones where it sets none: the planner reads
    those pages). Raises InvalidRequest (or OSError for a file it cannot read) before anything
    starts: a deployment of several models (not built yet), no or a bad plan."""
    if d.models:
        raise InvalidRequest("the planner sizes the pools of a one-model deployment; with "
                             "`models` it is not built yet", param="planner")
    if not d.planner_config:
        raise InvalidRequest("--planner needs --planner-config: a YAML file of the pools to "
                             "size, their targets and bounds (tandem.planner.config)",
                             param="planner_config")
    plan = read_planner_config(d.planner_config)
    check_plan(plan, model_topologies(d)[0])
    load_models(plan)
    count = d.frontend_processes or auto_frontend_processes()
    return dataclasses.replace(
        d, router_metrics_port=d.router_metrics_port or consecutive_free_ports(
            d.host, d.router_replicas),
        frontend_metrics_port=d.frontend_metrics_port or consecutive_free_ports(d.host, count)
    ), plan


def check_plan(plan: PlannerConfig, model: ModelTopology) -> None:
    """Raises InvalidRequest for a planner pool the deployment does not have, or whose role
    does not fit the pool's kind (a prefill pool sized as decode, ...)."""
    kinds = {p.name: p.kind for p in model.pools}
    disaggregated = "prefill" in kinds.values()
    for pool in plan.pools:
        kind = kinds.get(pool.name)
        if kind is None or kind not in SCALABLE_KINDS:
            scalable = [n for n, k in kinds.items() if k in SCALABLE_KINDS]
            raise InvalidRequest(f"planner pool '{pool.name}' is not a pool of the deployment "
                                 f"that the planner can size (those: {', '.join(scalable)})",
                                 param=f"{pool.name}.name")
        fits, needs_prefill = _ROLE_KINDS[pool.role]
        if kind not in fits or (needs_prefill and not disaggregated) or (
                pool.role == "agg" and disaggregated):
            mode = "a disaggregated" if disaggregated else "an aggregated"
            raise InvalidRequest(f"planner pool '{pool.name}' has role {pool.role}, but it is "
                                 f"a {kind} pool of {mode} deployment",
                                 param=f"{pool.name}.role")


def planner_process(d: Deployment, plan: PlannerConfig, workdir: pathlib.Path,
                    control_address: str) -> ServiceProcess:
    """The planner's process, acting through the launcher's control API at `control_address`;
    `d` and `plan` as `prepare` returned them. Writes its config into `workdir`."""
    path = workdir / "planner.yaml"
    path.write_text(yaml.safe_dump({"plan": config_lib.as_dict(plan)}))
    count = d.frontend_processes or auto_frontend_processes()
    frontends = [f"http://{d.host}:{d.frontend_metrics_port + i}/metrics" for i in range(count)]
    routers = [f"http://{d.host}:{d.router_metrics_port + i}/metrics"
               for i in range(d.router_replicas)]
    port = free_port(d.host)
    metrics = ["--metrics-port", str(d.planner_metrics_port)] if d.planner_metrics_port else []
    return ServiceProcess(PLANNER, f"{d.host}:{port}", serve_argv(
        "planner", "--host", d.host, "--port", str(port), "--config", str(path),
        "--frontend-metrics-urls", *frontends,
        "--router-metrics-urls", *routers,
        "--connector", "local", "--launcher-address", control_address,
        "--status-file", str(status_path(workdir)), *metrics,
        "--log-level", d.log_level, "--log-format", d.log_format), is_dialed_by_peers=False)
