"""How `tandem up --planner` and `tandem serve planner` are put together: the plan checked
against the deployment before anything starts, the planner's command line, its typed config,
its connectors."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import yaml

from services.planner.main import create_connector
from tandem.errors import InvalidRequest
from tandem.launcher.deployment import Deployment, DeploymentModel, DeploymentPool
from tandem.launcher.planner_process import planner_process, prepare
from tandem.launcher.processes import processes
from tandem.planner.config import planner_config_from_dict
from tandem.planner.service_config import PlannerServiceConfig
from tandem.runtime import config as config_lib

PROFILE = {"version": 1, "engine": "mock", "model": "t", "gpus_per_worker": 1,
           "prefill": [{"isl": 100, "tokens_per_s": 1000, "ttft_ms": 50}],
           "decode": [{"context_length": 100, "batch_size": 1, "itl_ms": 5}]}


def plan_file(tmp: pathlib.Path, *pools: dict[str, object], **plan: object) -> str:
    (tmp / "profile.json").write_text(json.dumps(PROFILE))
    for pool in pools:
        pool.setdefault("profile", str(tmp / "profile.json"))
    (tmp / "plan.yaml").write_text(yaml.safe_dump({"pools": list(pools), **plan}))
    return str(tmp / "plan.yaml")


AGG = {"name": "decode", "role": "agg", "ttft_target_ms": 500, "itl_target_ms": 50}


def test_the_planner_process_reads_the_services_pages_and_acts_through_the_launcher(
        tmp_path: pathlib.Path) -> None:
    d = Deployment(engine="mock", planner=True, planner_config=plan_file(tmp_path, AGG,
                                                                          interval_s=5),
                   frontend_processes=2, router_replicas=2, planner_metrics_port=9490)
    d, plan = prepare(d)
    assert d.router_metrics_port and d.frontend_metrics_port  # free ones, as none were set
    spec = planner_process(d, plan, tmp_path, "unix:/x/launcher.sock")
    argv = spec.argv[spec.argv.index("planner") + 1:]
    config = config_lib.load(PlannerServiceConfig, argv, prog="planner")
    config.check()
    f = d.frontend_metrics_port
    assert config.frontend_metrics_urls == [f"http://127.0.0.1:{f}/metrics",
                                            f"http://127.0.0.1:{f + 1}/metrics"]
    r = d.router_metrics_port
    assert config.router_metrics_urls == [f"http://127.0.0.1:{r}/metrics",
                                          f"http://127.0.0.1:{r + 1}/metrics"]
    routers = [s for s in processes(d, tmp_path) if s.name.startswith("router")]
    assert [s.argv[s.argv.index("--metrics-port") + 1] for s in routers] == [str(r), str(r + 1)]
    assert (config.connector, config.launcher_address) == ("local", "unix:/x/launcher.sock")
    assert config.status_file == str(tmp_path / "planner-status.json")
    assert config.metrics_port == 9490 and config.plan == plan and plan.interval_s == 5


@pytest.mark.parametrize(("pool", "deployment", "match"), [
    ({**AGG, "name": "nope"}, {}, "not a pool of the deployment"),
    ({"name": "decode", "role": "decode", "itl_target_ms": 50}, {}, "aggregated deployment"),
    (AGG, {"disagg": True}, "disaggregated deployment"),
    ({"name": "prefill", "role": "decode", "itl_target_ms": 50}, {"disagg": True},
     "a prefill pool"),
    ({**AGG, "name": "encode"}, {"encode_ports": [9400]}, "not a pool of the deployment"),
])
def test_a_plan_that_does_not_fit_the_deployment_stops_tandem_up_first(
        tmp_path: pathlib.Path, pool: dict[str, object], deployment: dict[str, object],
        match: str) -> None:
    d = Deployment(engine="reference", planner=True,
                   planner_config=plan_file(tmp_path, dict(pool)), **deployment)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=match):
        prepare(d)


def test_what_the_planner_needs_from_tandem_up(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidRequest, match="--planner-config"):
        prepare(Deployment(planner=True))
    models = [DeploymentModel("a", pools=[DeploymentPool("decode", "decode", [9200])])]
    with pytest.raises(InvalidRequest, match="one-model"):
        prepare(Deployment(planner=True, planner_config="x", models=models))
    (tmp_path / "bad.json").write_text("{}")
    bad = plan_file(tmp_path, {**AGG, "profile": str(tmp_path / "bad.json")})
    with pytest.raises(InvalidRequest, match="profile"):
        prepare(Deployment(planner=True, planner_config=bad))


def test_the_planner_service_config(tmp_path: pathlib.Path) -> None:
    plan = yaml.safe_load(pathlib.Path(plan_file(tmp_path, AGG)).read_text())
    (tmp_path / "planner.yaml").write_text(yaml.safe_dump({
        "frontend_metrics_urls": ["http://f/metrics"], "launcher_address": "unix:/s",
        "plan": plan}))
    config = config_lib.load(PlannerServiceConfig, [
        "--config", str(tmp_path / "planner.yaml"), "--interval-s", "7", "--gpu-budget", "3"],
        prog="planner")
    config.check()
    assert (config.plan.interval_s, config.plan.gpu_budget) == (7.0, 3)
    assert config.plan.pools[0].name == "decode"
    for broken, match in ((dict(frontend_metrics_urls=[]), "frontend"),
                          (dict(launcher_address=""), "launcher-address"),
                          (dict(plan=dataclasses.replace(config.plan, pools=[])), "pools")):
        with pytest.raises(InvalidRequest, match=match):
            dataclasses.replace(config, **broken).check()  # type: ignore[arg-type]


async def test_connectors_are_picked_by_name(tmp_path: pathlib.Path) -> None:
    config = PlannerServiceConfig(launcher_address="unix:/nowhere", connector="local")
    connector = await create_connector(config)
    await connector.close()
    with pytest.raises(InvalidRequest, match="one of local, kubernetes"):
        await create_connector(dataclasses.replace(config, connector="nomad"))


def test_the_readmes_plan_is_a_valid_plan() -> None:
    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    block = "# plan.yaml:" + readme.split("```yaml\n# plan.yaml:", 1)[1].split("```", 1)[0]
    plan = planner_config_from_dict(yaml.safe_load(block))
    assert [p.name for p in plan.pools] == ["decode"] and plan.gpu_budget == 4
