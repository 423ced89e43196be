"""deploy/k8s: the manifests parse, one Deployment per stage runs a command this version's CLI
accepts, workers probe the gRPC health service, drain inside their termination grace and
request GPUs, the router's DNS pools name the workers' headless Services, and the
ServiceMonitor finds every metrics port. The topology matches compose's gpu profile (and its
encode and embedding profiles); the frontend's embedding model is the embed workers' model.
The planner runs alone under its ServiceAccount, its config sizes the worker Deployments, and
its Role names exactly those."""
from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import yaml
from cli_capture import parse_serve

from services.common.worker_main import STAGES
from services.frontend.config import FrontendConfig
from services.planner.main import CONNECTORS
from services.router.main import build_router
from tandem.planner.service_config import PlannerServiceConfig, load_models
from tandem.routing.config import RouterConfig
from tandem.runtime.worker_config import WorkerConfig
from tandem.v1 import inference_pb2, router_pb2, video_pb2
from tandem.video.config import VideoWorkerConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "compose.yaml"
STAGE_NAMES = {"frontend", "router", "prefill", "decode", "encode", "embed", "video"}
#: The planner's Deployment: no serving stage (parsed() leaves it out).
PLANNER = "planner"
WORKER_STAGES = set(STAGES)
#: Stages on one GPU with the reference engine (diffusers; embeddings: TensorRT-LLM has neither).
REFERENCE_GPU_STAGES = {"video", "embed"}
#: The router pool kind of each worker stage (the stage's own name unless listed).
POOL_KIND = {"embed": "embedding"}
HEALTH_SERVICE = {
    "frontend": inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    "router": router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
    **{stage: spec.service_name for stage, spec in STAGES.items()},
    "video": video_pb2.DESCRIPTOR.services_by_name["Video"].full_name,
}
#: The value a `fieldRef` env var stands for while parsing (say, status.podIP).
FIELD_REF_PLACEHOLDER = "10.1.2.3"


def namespace() -> str:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]


def manifests() -> list[dict[str, Any]]:
    """Every document of every resource the kustomization lists."""
    resources = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    docs = [d for r in resources for d in yaml.safe_load_all((K8S / r).read_text()) if d]
    assert docs
    return docs


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    def substitute(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, arg)


def argv_of(deployment: dict[str, Any], tmp_path: pathlib.Path) -> list[str]:
    """The container's argv as the kubelet runs it, with files mounted from ConfigMaps written
    under tmp_path."""
    spec = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    env = {e["name"]: e.get("value", FIELD_REF_PLACEHOLDER) for e in c.get("env", [])}
    argv = [expand(a, env) for a in [*c["command"], *c.get("args", [])]]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    config_maps = of_kind("ConfigMap")
    for i, arg in enumerate(argv[:-1]):
        if arg != "--config":
            continue
        path = pathlib.PurePosixPath(argv[i + 1])
        mount = next(m for m in c["volumeMounts"] if path.parent == pathlib.PurePosixPath(
            m["mountPath"]))
        data = config_maps[volumes[mount["name"]]["configMap"]["name"]]["data"]
        local = tmp_path / path.name
        local.write_text(data[path.name])
        argv[i + 1] = str(local)
    return argv


def parsed(tmp_path: pathlib.Path) -> dict[str, tuple[dict[str, Any], Any]]:
    """stage -> (Deployment, config) for every Deployment of a serving stage."""
    out = {}
    for name, deployment in of_kind("Deployment").items():
        if name == PLANNER:
            continue
        stage, config = parse_serve(argv_of(deployment, tmp_path))
        assert stage not in out, f"two Deployments run {stage}"
        out[stage] = (deployment, config)
    return out


def grpc_port(config: Any) -> int:
    return config.grpc_port if isinstance(config, FrontendConfig) else config.port


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def headless_service(stage: str, deployment: dict[str, Any]) -> dict[str, Any]:
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    matches = [s for s in of_kind("Service").values() if s["spec"].get("clusterIP") == "None"
               and selects(s["spec"]["selector"], pod_labels)]
    assert len(matches) == 1, f"{stage}: {len(matches)} headless Services"
    return matches[0]


# ---- the manifests --------------------------------------------------------------------------

def test_every_manifest_parses_and_is_listed() -> None:
    resources = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert files == resources
    kinds = [d["kind"] for d in manifests()]
    for doc in manifests():
        assert doc["apiVersion"] and doc["metadata"]["name"]
    assert kinds.count("Deployment") == len(STAGE_NAMES) + 1 == 8  # and the planner
    assert kinds.count("ServiceMonitor") == 1 and kinds.count("ConfigMap") == 2
    assert kinds.count("ServiceAccount") == kinds.count("Role") == 1
    assert kinds.count("RoleBinding") == 1
    assert set(of_kind("Namespace")) == {namespace()}


def test_one_deployment_per_stage(tmp_path: pathlib.Path) -> None:
    stages = parsed(tmp_path)
    assert set(stages) == STAGE_NAMES
    for stage, (deployment, _) in stages.items():
        assert deployment["metadata"]["name"] == stage


def test_container_commands_parse_with_the_cli(tmp_path: pathlib.Path) -> None:
    stages = parsed(tmp_path)
    assert len(stages) == len(STAGE_NAMES)
    for stage, (deployment, config) in stages.items():
        assert config.host == "0.0.0.0", stage
        ports = {p["containerPort"] for p in container(deployment)["ports"]}
        assert grpc_port(config) in ports, f"{stage} does not expose its gRPC port"
        if stage in WORKER_STAGES:
            assert isinstance(config, WorkerConfig)
            # Each pod advertises its own IP: prefill leases are released at that address.
            assert config.worker_id == f"{FIELD_REF_PLACEHOLDER}:{config.port}", stage
            pod_ip = next(e for e in container(deployment)["env"] if e["name"] == "POD_IP")
            assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        elif stage == "router":
            build_router(config)
        elif stage == "video":
            assert isinstance(config, VideoWorkerConfig)
            assert config.worker_id == f"{FIELD_REF_PLACEHOLDER}:{config.port}"


def test_an_unknown_flag_fails_the_parser(tmp_path: pathlib.Path) -> None:
    argv = argv_of(of_kind("Deployment")["decode"], tmp_path)
    with pytest.raises(SystemExit):
        parse_serve([*argv, "--no-such-flag"])


# ---- probes, drain, resources ---------------------------------------------------------------

def test_probes_use_the_grpc_health_service(tmp_path: pathlib.Path) -> None:
    for stage, (deployment, config) in parsed(tmp_path).items():
        c = container(deployment)
        readiness = c["readinessProbe"]["grpc"]
        assert readiness == {"port": grpc_port(config), "service": HEALTH_SERVICE[stage]}, stage
        assert "livenessProbe" in c, stage
        if stage == "router":
            # Its health says "some worker is healthy", not "the router is alive".
            assert c["livenessProbe"]["tcpSocket"]["port"] == config.port
            continue
        liveness = c["livenessProbe"]["grpc"]
        assert liveness["port"] == grpc_port(config)
        assert liveness.get("service", "") in ("", HEALTH_SERVICE[stage])
        if stage in WORKER_STAGES or stage == "video":
            assert c["startupProbe"]["grpc"] == readiness


def test_termination_grace_covers_prestop_and_drain(tmp_path: pathlib.Path) -> None:
    stages = parsed(tmp_path)
    for stage, (deployment, config) in stages.items():
        c = container(deployment)
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep" and len(command) == 2, stage
        pre_stop_s = float(command[1])
        assert pre_stop_s > 0
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > pre_stop_s + config.grace_period_s, stage


def test_a_pool_the_planner_shrinks_drains_before_probes_or_routing_interfere(
        tmp_path: pathlib.Path) -> None:
    """A pod the planner removes leaves its headless Service's endpoints at once: the router
    re-resolves its DNS pool before preStop ends, so nothing new reaches the pod when SIGTERM
    starts the drain; and its health, NOT_SERVING from then on, must not fail the liveness
    probe (a kill, its streams lost) before the drain's grace period is over."""
    stages = parsed(tmp_path)
    router = stages["router"][1]
    for stage in ("prefill", "decode"):
        deployment, config = stages[stage]
        c = container(deployment)
        pre_stop_s = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert router.dns_refresh_s < pre_stop_s, stage
        liveness = c["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > config.grace_period_s


def test_gpu_stages_request_one_gpu_and_every_container_has_resources(
        tmp_path: pathlib.Path) -> None:
    gpus = 0
    for stage, (deployment, config) in parsed(tmp_path).items():
        resources = container(deployment)["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"], stage
        assert resources["limits"]["memory"], stage
        if stage in REFERENCE_GPU_STAGES:
            assert (config.engine, config.engine_args.device) == ("reference", "cuda"), stage
        elif stage in WORKER_STAGES:
            assert config.engine == "trtllm", stage
        if stage in WORKER_STAGES or stage in REFERENCE_GPU_STAGES:
            assert resources["requests"]["nvidia.com/gpu"] == 1, stage
            assert resources["limits"]["nvidia.com/gpu"] == 1, stage
            assert container(deployment)["image"].startswith("tandem-trtllm:"), stage
            gpus += 1
        else:
            assert "nvidia.com/gpu" not in resources["limits"], stage
    assert gpus == len(WORKER_STAGES | REFERENCE_GPU_STAGES)  # and the video worker


# ---- discovery ------------------------------------------------------------------------------

def test_router_pools_resolve_the_headless_services(tmp_path: pathlib.Path) -> None:
    stages = parsed(tmp_path)
    router = stages["router"][1]
    assert isinstance(router, RouterConfig)
    pools = {p.kind: p for p in router.pools}
    assert set(pools) == {"prefill", "decode", "encode", "video", "embedding"}
    for stage in [*WORKER_STAGES, "video"]:
        deployment, worker = stages[stage]
        service = headless_service(stage, deployment)
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["grpc"]["port"] == worker.port
        assert ports["grpc"]["targetPort"] in {p["name"] for p in container(deployment)["ports"]}
        pool = pools[POOL_KIND.get(stage, stage)]
        expected = f"{service['metadata']['name']}.{namespace()}.svc.cluster.local:{worker.port}"
        assert pool.dns == expected and not pool.workers, stage
        if stage != "video":  # no KV blocks there
            assert router.block_size == worker.engine_args.kv_block_size


def test_frontend_reaches_every_router_replica(tmp_path: pathlib.Path) -> None:
    """Two router replicas; the frontend expands a headless Service's DNS name to every ready
    router pod (RouterClient's dns: addresses)."""
    stages = parsed(tmp_path)
    frontend, router = stages["frontend"][1], stages["router"][1]
    assert stages["router"][0]["spec"]["replicas"] == 2
    assert frontend.router_address.startswith("dns:")
    host, _, port = frontend.router_address.removeprefix("dns:").rpartition(":")
    service = of_kind("Service")[host]
    assert service["spec"].get("clusterIP") == "None"
    assert selects(service["spec"]["selector"],
                   stages["router"][0]["spec"]["template"]["metadata"]["labels"])
    assert {p["port"] for p in service["spec"]["ports"]} >= {int(port)} and int(port) == router.port


def test_service_monitor_selects_every_metrics_port(tmp_path: pathlib.Path) -> None:
    stages = parsed(tmp_path)
    monitor = next(iter(of_kind("ServiceMonitor").values()))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    selected = [s for s in of_kind("Service").values()
                if selects(selector, s["metadata"].get("labels", {}))]
    scraped: dict[str, int] = {}
    for service in selected:
        for port in service["spec"]["ports"]:
            if port["name"] in endpoint_ports:
                scraped[service["metadata"]["name"]] = port["port"]
    assert scraped["router"] == stages["router"][1].metrics_port
    assert scraped["frontend"] == stages["frontend"][1].metrics_port
    for stage in [*WORKER_STAGES, "video"]:
        deployment, worker = stages[stage]
        name = headless_service(stage, deployment)["metadata"]["name"]
        assert worker.metrics_port and scraped[name] == worker.metrics_port, stage
        assert {"name": "metrics", "containerPort": worker.metrics_port} in (
            container(deployment)["ports"])
    # Every port named `metrics` anywhere is on a Service the monitor selects.
    for service in of_kind("Service").values():
        if any(p["name"] == "metrics" for p in service["spec"]["ports"]):
            assert service in selected, service["metadata"]["name"]


# ---- the same topology as compose -----------------------------------------------------------

def _compose_gpu_workers() -> dict[str, WorkerConfig]:
    compose = yaml.safe_load(COMPOSE.read_text())
    out = {}
    for service in compose["services"].values():
        command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in service.get("command", [])]
        if (command[:2] == ["tandem", "serve"] and command[2] in WORKER_STAGES
                and service.get("profiles") in (["gpu"], ["encode"], ["embedding"])):
            stage, config = parse_serve(command)
            out[stage] = config
    return out


def test_k8s_runs_compose_gpu_topology(tmp_path: pathlib.Path) -> None:
    stages = parsed(tmp_path)
    compose = _compose_gpu_workers()
    assert set(compose) == WORKER_STAGES
    for stage, theirs in compose.items():
        ours = stages[stage][1]
        for f in ("engine", "disaggregation_mode", "served_model_name", "grace_period_s",
                  "port", "metrics_port"):
            assert getattr(ours, f) == getattr(theirs, f), f"{stage} {f}"
        assert ours.engine_args == theirs.engine_args, stage
    compose_router = yaml.safe_load((ROOT / "deploy/compose/router.yaml").read_text())
    router = stages["router"][1]
    assert sorted(p.kind for p in router.pools) == sorted(
        p["kind"] for p in compose_router["pools"])
    assert router.block_size == compose_router["block_size"]
    assert router.metrics_port == compose_router["metrics_port"]


def _pvc_mounted_at(deployment: dict[str, Any], path: str) -> str:
    """The PersistentVolumeClaim mounted read-only at `path` in the Deployment's container."""
    mount = next(m for m in container(deployment)["volumeMounts"] if m["mountPath"] == path)
    assert mount.get("readOnly") is True, path
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    return volume["persistentVolumeClaim"]["claimName"]


def test_frontend_embeds_with_the_embed_workers_model(tmp_path: pathlib.Path) -> None:
    """The frontend's embedding model (off by default) is the embed workers' served model, its
    tokenizer read from the same volume the workers load the weights from."""
    stages = parsed(tmp_path)
    deployment, frontend = stages["frontend"]
    env = {e["name"]: e["value"] for e in container(deployment)["env"] if "value" in e}
    _, with_env = parse_serve(argv_of(deployment, tmp_path), env)
    assert isinstance(with_env, FrontendConfig) and with_env.embedding_model == ""  # off
    embed = stages["embed"][1]
    _, on = parse_serve(argv_of(deployment, tmp_path),
                        {**env, "TANDEM_EMBEDDING_MODEL": embed.served_model_name})
    assert on.embedding_model == embed.served_model_name
    claim = _pvc_mounted_at(stages["embed"][0], embed.engine_args.model)
    assert claim in {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim").values()}
    assert claim != _pvc_mounted_at(deployment, frontend.model)  # its own checkpoint
    assert _pvc_mounted_at(deployment, on.embedding_model_path) == claim


def test_a_failing_service_writes_its_reason_where_kubernetes_reads_it() -> None:
    """`kubectl describe pod` shows the container's termination message: every service writes
    its one-line failure reason ($TANDEM_TERMINATION_LOG) to the path Kubernetes reads."""
    deployments = of_kind("Deployment")
    assert deployments
    for name, deployment in deployments.items():
        spec = container(deployment)
        env = {e["name"]: e.get("value") for e in spec.get("env", [])}
        read_from = spec.get("terminationMessagePath", "/dev/termination-log")
        assert env.get("TANDEM_TERMINATION_LOG") == read_from, name


# ---- the planner ----------------------------------------------------------------------------

def _planner(tmp_path: pathlib.Path) -> tuple[dict[str, Any], PlannerServiceConfig]:
    """The planner's Deployment and the config its command builds, every file of its ConfigMap
    written under tmp_path as the pod sees it mounted (the config's paths to them rewritten)."""
    deployment = of_kind("Deployment")[PLANNER]
    c = container(deployment)
    (mount,) = c["volumeMounts"]
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    argv = argv_of(deployment, tmp_path)
    data = of_kind("ConfigMap")[volume["configMap"]["name"]]["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text.replace(mount["mountPath"] + "/", f"{tmp_path}/"))
    path = pathlib.PurePosixPath(c["args"][c["args"].index("--config") + 1])
    assert str(path.parent) == mount["mountPath"]
    argv[argv.index("--config") + 1] = str(tmp_path / path.name)
    stage, config = parse_serve(argv)
    assert stage == PLANNER and isinstance(config, PlannerServiceConfig)
    return deployment, config


def test_planner_runs_alone_under_its_service_account(tmp_path: pathlib.Path) -> None:
    deployment, config = _planner(tmp_path)
    spec = deployment["spec"]
    # Two planners would both set the counts, also for a moment during a rollout.
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    c = container(deployment)
    assert c["command"] == ["tandem", "serve", "planner"] and config.host == "0.0.0.0"
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": config.port, "service": ""}, probe
    account = spec["template"]["spec"]["serviceAccountName"]
    assert account in of_kind("ServiceAccount")
    (binding,) = of_kind("RoleBinding").values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": namespace()}]
    assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] in of_kind("Role")


def test_planner_config_sizes_the_worker_deployments(tmp_path: pathlib.Path) -> None:
    """Each pool is a worker Deployment of its role and GPUs per worker, whose count the
    planner owns; its profile loads, fits it and reaches its target; the Role may scale
    exactly these Deployments; the connector is one the service knows."""
    _, config = _planner(tmp_path)
    config.check()
    models = load_models(config.plan)
    stages = parsed(tmp_path)
    assert config.connector == "kubernetes"
    assert config.connector in CONNECTORS, (
        "services/planner/main.py must register the Kubernetes connector: "
        "tandem.planner.k8s.create_connector")
    for pool in config.plan.pools:
        deployment, worker = stages[pool.name]  # a Deployment named after its pool
        assert deployment["metadata"]["name"] == pool.name
        # The planner owns the count: a manifest that set it would reset it on each apply.
        assert "replicas" not in deployment["spec"], pool.name
        # A worker's mode is its role: prefill, decode, or agg (a decode stage that prefills).
        assert worker.disaggregation_mode == pool.role, pool.name
        gpus = container(deployment)["resources"]["limits"]["nvidia.com/gpu"]
        assert pool.gpus_per_worker == gpus
        model = models[pool.name]
        if pool.uses_prefill:
            assert model.prefill_capacity(1024, pool.ttft_target_ms) > 0
        if pool.uses_decode:
            assert model.decode_capacity(1024, pool.itl_target_ms) > 0
    (role,) = of_kind("Role").values()
    scaled = [r for r in role["rules"] if r["resources"] == ["deployments/scale"]]
    assert len(scaled) == 1
    assert sorted(scaled[0]["resourceNames"]) == sorted(p.name for p in config.plan.pools)


def test_planner_reads_the_metrics_services(tmp_path: pathlib.Path) -> None:
    """Its metrics URLs are Services of this namespace, on their metrics ports."""
    _, config = _planner(tmp_path)
    services = of_kind("Service")
    urls = [*config.frontend_metrics_urls, *config.router_metrics_urls]
    assert config.frontend_metrics_urls and config.router_metrics_urls
    for url in urls:
        m = re.fullmatch(r"http://([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)/metrics",
                         url)
        assert m, url
        name, ns, port = m.group(1), m.group(2), int(m.group(3))
        assert ns == namespace() and name in services, url
        ports = {p["name"]: p["port"] for p in services[name]["spec"]["ports"]}
        assert ports.get("metrics") == port, url
