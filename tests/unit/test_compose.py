"""compose.yaml: valid Compose, every `tandem serve` command accepted by this version's CLI, the
same topology as `tandem up`, gRPC health checks, drains that fit stop_grace_period, GPU
reservations, and every file it references present.

The Compose schema is the in-repo copy deploy/compose/compose-spec.json (from the compose-spec
project, as shipped in the project's shared/data/), so that CI's fresh clone needs nothing else.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import jsonschema
import pytest
import yaml
from cli_capture import parse_serve

from services.common.worker_main import STAGES
from services.frontend.config import FrontendConfig
from services.router.main import build_router
from tandem.launcher import up
from tandem.launcher.deployment import Deployment
from tandem.launcher.processes import processes
from tandem.routing.config import RouterConfig
from tandem.runtime.worker_config import WorkerConfig
from tandem.v1 import inference_pb2, router_pb2, video_pb2
from tandem.video.config import VideoWorkerConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
SCHEMA = ROOT / "deploy" / "compose" / "compose-spec.json"
HEALTH_SCRIPT = ROOT / "deploy" / "docker" / "grpc_health_check.py"
#: Where the Dockerfiles install HEALTH_SCRIPT.
HEALTH_COMMAND = "grpc-health-check"
WORKER_STAGES = set(STAGES)
#: gRPC service name each stage registers with the health service (besides "").
HEALTH_SERVICE = {
    "frontend": inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    "router": router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
    **{stage: spec.service_name for stage, spec in STAGES.items()},
    "video": video_pb2.DESCRIPTOR.services_by_name["Video"].full_name,
}
TOPOLOGY_PROFILES = {"gpu": {"frontend", "router", "prefill", "decode"},
                     "cpu": {"frontend", "router", "prefill", "decode"},
                     "encode": {"encode"}, "video": {"video"}, "embedding": {"embed"}}
#: Stages on one GPU with the reference engine (diffusers; embeddings: TensorRT-LLM has neither).
REFERENCE_GPU_STAGES = {"video", "embed"}
#: Router pools whose workers run in a profile of their own: pool kind -> compose service.
OWN_PROFILE_POOLS = {"encode": "encode", "video": "video", "embedding": "embed"}
OBSERVABILITY = {"prometheus", "grafana", "jaeger"}


# ---- helpers --------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(?P<braced>[A-Za-z_]\w*)(?P<op>:?[-?])?|\$(?P<bare>[A-Za-z_]\w*)")


def _closing_brace(text: str, start: int) -> int:
    """Index of the `}` that closes a braced expression whose argument starts at `start`
    (arguments may hold braced expressions themselves)."""
    depth = 0
    for i in range(start, len(text)):
        if text.startswith("${", i):
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return i
            depth -= 1
    raise AssertionError(f"unclosed ${{ in {text!r}")


def _interpolate_str(text: str, env: Mapping[str, str]) -> str:
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        m = _VARIABLE.match(text, i) if text[i] == "$" else None
        if m is None:
            out.append(text[i])
            i += 1
            continue
        name, op = m.group("braced") or m.group("bare"), m.group("op")
        arg, i = "", m.end()
        if m.group("braced"):
            end = _closing_brace(text, i)
            assert op or end == i, f"unsupported expression in {text!r}"
            arg, i = text[i:end], end + 1
        current = env.get(name)
        unset = current is None or (current == "" and op is not None and op.startswith(":"))
        if not unset:
            out.append(str(current))
        elif op in (":-", "-"):
            out.append(_interpolate_str(arg, env))  # defaults may name variables too
        else:
            raise AssertionError(f"compose variable {name} is required ({arg or 'no default'})")
    return "".join(out)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err},
    $$, defaults that are expressions themselves: ${A:-${B:-x}}) over every string of a loaded
    compose file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    return _interpolate_str(value, env)


def load_compose() -> dict[str, Any]:
    """compose.yaml as Compose sees it with no variables set (every variable has a default)."""
    return interpolate(yaml.safe_load(COMPOSE.read_text()), {})


def tandem_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = {name: s for name, s in compose["services"].items()
                if s.get("command", [])[:2] == ["tandem", "serve"]}
    assert len(services) == sum(map(len, TOPOLOGY_PROFILES.values()))
    return services


def profile_of(service: dict[str, Any]) -> str:
    profiles = service.get("profiles", [])
    assert len(profiles) == 1, f"a topology service belongs to exactly one profile: {profiles}"
    return profiles[0]


def dns_names(name: str, service: dict[str, Any]) -> set[str]:
    """Names other containers reach `service` by: its own and its network aliases."""
    aliases = {a for net in (service.get("networks") or {}).values() if net
               for a in net.get("aliases", [])}
    return {name, *aliases}


def bind_mounts(service: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(source, target) of every bind mount, short or long syntax."""
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                yield source, target
        elif volume["type"] == "bind":
            yield volume["source"], volume["target"]


def with_host_paths(name: str, service: dict[str, Any]) -> list[str]:
    """The service's command with `--config FILE` pointing at the mounted file in the repo."""
    argv = list(service["command"])
    mounts = {target: source for source, target in bind_mounts(service)}
    for i, arg in enumerate(argv[:-1]):
        if arg == "--config":
            assert argv[i + 1] in mounts, f"{name}: --config {argv[i + 1]} is not mounted"
            argv[i + 1] = str(ROOT / mounts[argv[i + 1]])
    return argv


def parsed_services(compose: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    return {name: parse_serve(with_host_paths(name, s))
            for name, s in tandem_services(compose).items()}


def by_profile(compose: dict[str, Any], profile: str) -> dict[str, tuple[str, Any]]:
    """stage -> (service name, config) of one profile's topology services."""
    services = tandem_services(compose)
    out = {}
    for name, (stage, config) in parsed_services(compose).items():
        if profile_of(services[name]) == profile:
            assert stage not in out, f"two {stage} services in profile {profile}"
            out[stage] = (name, config)
    return out


def grpc_port(config: Any) -> int:
    return config.grpc_port if isinstance(config, FrontendConfig) else config.port


def dockerfile_of(service: dict[str, Any]) -> pathlib.Path:
    build = service["build"]
    return ROOT / build["context"] / build["dockerfile"]


def seconds(duration: str) -> float:
    """A Compose duration ("45s", "1m30s", "20m") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def up_deployment(argv: Sequence[str]) -> Deployment | None:
    """The Deployment `tandem up ARGV` would start, or None when `tandem up` rejects ARGV."""
    captured: list[Deployment] = []

    async def fake_run(d: Deployment) -> int:
        captured.append(d)
        return 0

    with mock.patch.object(up, "run", fake_run), mock.patch.object(up.logs, "setup"):
        try:
            up.main(list(argv))
        except SystemExit:
            pass
    return captured[0] if captured else None


# ---- the file itself ------------------------------------------------------------------------

def test_compose_validates_against_the_compose_spec() -> None:
    schema = json.loads(SCHEMA.read_text())
    # It declares draft-07 as "https://json-schema.org/draft-07/schema", a spelling jsonschema
    # does not map to a validator by itself.
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    compose = load_compose()
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(compose)]
    assert errors == []
    assert len(compose["services"]) >= 9


def test_schema_validation_can_fail() -> None:
    schema = json.loads(SCHEMA.read_text())
    compose = load_compose()
    compose["services"]["decode"]["stop_grace_period"] = 45  # must be a string
    compose["services"]["router"]["healthcheck"]["tset"] = ["CMD", "true"]
    assert len(list(jsonschema.Draft7Validator(schema).iter_errors(compose))) == 2


def test_schema_copy_matches_the_shared_original() -> None:
    shared = ROOT.parent / "shared" / "data" / "compose-spec.json"
    if not shared.exists():
        pytest.skip("no shared/ beside this checkout")
    assert json.loads(SCHEMA.read_text()) == json.loads(shared.read_text())


def test_interpolation_needs_no_variables_and_honours_them() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    assert "$" not in json.dumps(load_compose())
    gpu = interpolate(raw, {"MODEL_DIR": "/data/llama", "TRTLLM_TAG": "9.9.9"})["services"]
    assert {v["source"] for v in gpu["decode"]["volumes"] if isinstance(v, dict)} == {
        "/data/llama"}
    assert gpu["decode"]["build"]["args"]["TRTLLM_TAG"] == "9.9.9"
    # The embedding model's directory falls back to MODEL_DIR (a path that exists), so a
    # frontend without embeddings starts wherever the main checkpoint is.
    for name in ("frontend", "embed"):
        assert ("/data/llama", "/embed-model") in bind_mounts(gpu[name]), name
    embedding = interpolate(raw, {"MODEL_DIR": "/data/llama", "EMBEDDING_MODEL_DIR": "/data/e5"})
    for name in ("frontend", "embed"):
        assert ("/data/e5", "/embed-model") in bind_mounts(embedding["services"][name]), name
    with pytest.raises(AssertionError, match="required"):
        interpolate("${NEEDED:?set it}", {})


# ---- services and their commands ------------------------------------------------------------

def test_profiles_hold_the_topology() -> None:
    compose = load_compose()
    services = tandem_services(compose)
    stages = {name: s["command"][2] for name, s in services.items()}
    for profile, expected in TOPOLOGY_PROFILES.items():
        assert {stages[n] for n, s in services.items() if profile_of(s) == profile} == expected
    # The gpu profile's services carry the stage names; the cpu twins answer to them as aliases.
    for name, service in services.items():
        assert stages[name] in dns_names(name, service)
        if profile_of(service) != "cpu":
            assert name == stages[name]
    assert OBSERVABILITY <= set(compose["services"])
    for name in OBSERVABILITY:
        assert "profiles" not in compose["services"][name], f"{name} runs in every profile"


def test_every_tandem_command_parses_with_the_cli() -> None:
    compose = load_compose()
    services = tandem_services(compose)
    parsed = parsed_services(compose)
    assert len(parsed) == len(services) == 11
    for name, (stage, config) in parsed.items():
        assert config.host == "0.0.0.0", f"{name} must listen on every interface"
        assert config.grace_period_s > 0
        if stage in WORKER_STAGES:
            assert isinstance(config, WorkerConfig)
            host, _, port = config.worker_id.rpartition(":")
            assert host in dns_names(name, services[name]) and int(port) == config.port, (
                f"{name}: --worker-id {config.worker_id} is not an address others can reach")
            assert config.disaggregation_mode in STAGES[stage].modes
        elif stage == "router":
            build_router(config)  # pools, kinds and policies are valid
        elif stage == "video":
            assert isinstance(config, VideoWorkerConfig)
            assert config.worker_id == f"{name}:{config.port}"
        else:
            assert isinstance(config, FrontendConfig)


def test_an_unknown_flag_fails_the_parser() -> None:
    compose = load_compose()
    argv = [*compose["services"]["decode"]["command"], "--no-such-flag", "1"]
    with pytest.raises(SystemExit) as exc:
        parse_serve(argv)
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parse_serve(["tandem", "serve", "decode", "--kv-block-size", "many"])


def test_gpu_workers_run_trtllm_on_one_reserved_gpu() -> None:
    compose = load_compose()
    services = tandem_services(compose)
    gpu_workers = 0
    for name, (stage, config) in parsed_services(compose).items():
        service = services[name]
        devices = (service.get("deploy", {}).get("resources", {}).get("reservations", {})
                   .get("devices", []))
        dockerfile = dockerfile_of(service).read_text()
        if profile_of(service) == "cpu":
            assert devices == []
            # The base is a build argument (deploy/podman/build.sh passes a Debian one); its
            # default stays the slim Python image.
            assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
            assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, re.M)
            if stage in WORKER_STAGES:
                assert (config.engine, config.engine_args.device) == ("reference", "cpu")
                assert config.engine_args.model == "", "the cpu profile serves the demo model"
            continue
        # Video: diffusers on the GPU (visual_gen is not in the release image). Embeddings:
        # TensorRT-LLM has no embedding path. Both run in the TensorRT-LLM image (CUDA torch).
        if stage in REFERENCE_GPU_STAGES:
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
            assert (config.engine, config.engine_args.device) == ("reference", "cuda")
            assert re.search(r"^FROM nvcr\.io/nvidia/tensorrt-llm/release:\$\{TRTLLM_TAG\}$",
                             dockerfile, re.M), name
            continue
        if stage not in WORKER_STAGES:
            assert devices == [], f"{name} needs no GPU"
            continue
        gpu_workers += 1
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert config.engine == "trtllm"
        assert config.engine_args.model == "/model"
        assert ("${MODEL_DIR:-./models}", "/model") in bind_mounts(
            yaml.safe_load(COMPOSE.read_text())["services"][name])
        assert re.search(r"^FROM nvcr\.io/nvidia/tensorrt-llm/release:\$\{TRTLLM_TAG\}$",
                         dockerfile, re.M)
        assert service["build"]["args"]["TRTLLM_TAG"]
    assert gpu_workers == 3


def test_cpu_image_installs_torch_from_the_cpu_index() -> None:
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.cpu").read_text()
    assert "ARG TORCH_VERSION=2.13.0" in dockerfile
    # The index is a build argument whose default is PyTorch's CPU index (empty: pip's own
    # configuration, e.g. a local wheel directory).
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" '
                     r'\$\{TORCH_INDEX_URL:\+--index-url "\$TORCH_INDEX_URL"\}', dockerfile)
    assert "tandem demo-model" in dockerfile


def test_health_checks_use_the_grpc_health_service() -> None:
    compose = load_compose()
    services = tandem_services(compose)
    for name, (stage, config) in parsed_services(compose).items():
        test = services[name]["healthcheck"]["test"]
        assert test == ["CMD", HEALTH_COMMAND, f"127.0.0.1:{grpc_port(config)}",
                        "--service", HEALTH_SERVICE[stage]], name
        dockerfile = dockerfile_of(services[name]).read_text()
        assert f"COPY deploy/docker/grpc_health_check.py /usr/local/bin/{HEALTH_COMMAND}" in (
            dockerfile), f"{name}'s image lacks the health check"


def test_stop_grace_period_outlasts_the_drain() -> None:
    compose = load_compose()
    services = tandem_services(compose)
    for name, (_, config) in parsed_services(compose).items():
        assert seconds(services[name]["stop_grace_period"]) > config.grace_period_s, name
    assert seconds("1m30s") == 90


def test_referenced_files_exist() -> None:
    compose = load_compose()
    checked = 0
    for name, service in compose["services"].items():
        if "build" in service:
            assert dockerfile_of(service).is_file(), name
            checked += 1
        for source, _ in bind_mounts(service):
            # MODEL_DIR's, EMBEDDING_MODEL_DIR's and VIDEO_MODEL_DIR's defaults: the
            # user's checkpoints.
            if not source.startswith(("./models", "./video-models")):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
                checked += 1
    provisioning = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "tandem.yml"
    grafana = compose["services"]["grafana"]
    mounts = {target: source for source, target in bind_mounts(grafana)}
    path = yaml.safe_load(provisioning.read_text())["providers"][0]["options"]["path"]
    assert list((ROOT / mounts[path]).glob("*.json"))
    home = pathlib.PurePosixPath(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (ROOT / mounts[str(home.parent)] / home.name).is_file()
    assert checked >= 12


# ---- the topology ---------------------------------------------------------------------------

def test_router_pools_point_at_the_worker_services() -> None:
    compose = load_compose()
    services = tandem_services(compose)
    for profile in ("gpu", "cpu"):
        topology = by_profile(compose, profile)
        _, router = topology["router"]
        assert isinstance(router, RouterConfig)
        kinds = {"prefill": "prefill", "decode": "decode"}
        assert sorted(p.kind for p in router.pools) == sorted([*kinds.values(),
                                                               *OWN_PROFILE_POOLS])
        for pool in router.pools:
            assert pool.dns and not pool.workers, "DNS pools follow `--scale`"
            host, _, port = pool.dns.rpartition(":")
            if pool.kind in OWN_PROFILE_POOLS:  # their workers run in their own profiles
                name = OWN_PROFILE_POOLS[pool.kind]
                _, worker = parse_serve(services[name]["command"])
                assert host in dns_names(name, services[name])
                assert int(port) == worker.port
                continue
            stage = next(s for s, k in kinds.items() if k == pool.kind)
            name, worker = topology[stage]
            assert host in dns_names(name, services[name]) and int(port) == worker.port
            assert router.block_size == worker.engine_args.kv_block_size
        _, frontend = topology["frontend"]
        # dns: every router container behind the name (`--scale router=2` adds a replica).
        assert frontend.router_address.startswith("dns:")
        host, _, port = frontend.router_address.removeprefix("dns:").rpartition(":")
        assert host in dns_names(topology["router"][0], services[topology["router"][0]])
        assert int(port) == router.port


def test_gpu_frontend_embeds_with_the_embedding_profiles_model() -> None:
    """/v1/embeddings is off unless EMBEDDING_SERVED_MODEL_NAME is set; set, the gpu frontend
    serves the embed worker's model by the worker's served name, with the tokenizer from the
    directory the worker loads."""
    raw = yaml.safe_load(COMPOSE.read_text())

    def frontend_and_embed(env: dict[str, str]) -> tuple[FrontendConfig, WorkerConfig]:
        services = interpolate(raw, env)["services"]
        frontend = services["frontend"]
        frontend_env = {k: str(v) for k, v in frontend["environment"].items()}
        _, config = parse_serve(frontend["command"], frontend_env)
        _, embed = parse_serve(services["embed"]["command"])
        mounts = {t: s for s, t in bind_mounts(frontend)}
        assert mounts[config.embedding_model_path] == {
            t: s for s, t in bind_mounts(services["embed"])}[embed.engine_args.model]
        return config, embed

    off, _ = frontend_and_embed({})
    assert off.embedding_model == ""
    for env in ({"EMBEDDING_SERVED_MODEL_NAME": "e5"},
                {"EMBEDDING_SERVED_MODEL_NAME": "e5", "EMBEDDING_MODEL_DIR": "/data/e5",
                 "MODEL_DIR": "/data/llama"}):
        on, embed = frontend_and_embed(env)
        assert on.embedding_model == embed.served_model_name == "e5"


def test_gpu_and_cpu_profiles_run_the_same_topology() -> None:
    compose = load_compose()
    gpu, cpu = by_profile(compose, "gpu"), by_profile(compose, "cpu")
    assert set(gpu) == set(cpu)
    for stage in gpu:
        (_, a), (_, b) = gpu[stage], cpu[stage]
        assert grpc_port(a) == grpc_port(b) and a.grace_period_s == b.grace_period_s
        if stage in WORKER_STAGES:
            assert a.disaggregation_mode == b.disaggregation_mode
            assert a.engine_args.kv_block_size == b.engine_args.kv_block_size
        if stage == "router":
            assert a == b


#: Fields compose and `tandem up` set differently on purpose, by the config they belong to.
#: Everything else must be equal, so a flag added to one and not the other fails.
NOT_COMPARED: dict[type, set[str]] = {
    # Addresses (ports are compared below); the device is explicit in a container.
    WorkerConfig: {"host", "port", "worker_id", "metrics_port"},
    # Compose's pools are DNS pools (kinds are compared below) re-resolved every
    # dns_refresh_s, with the KV-aware policy; compose runs Prometheus.
    RouterConfig: {"host", "pools", "decode_workers", "policy", "dns_refresh_s",
                   "metrics_port"},
    FrontendConfig: {"host", "router_address", "metrics_port"},
}


def _comparable(config: Any) -> dict[str, Any]:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in NOT_COMPARED[type(config)]}
    if "engine_args" in values:
        values["engine_args"] = dataclasses.replace(values["engine_args"], device="cpu")
    return values


def test_compose_agrees_with_tandem_up(tmp_path: pathlib.Path) -> None:
    """The cpu profile (reference engine, demo model) is what `tandem up --disagg` starts as
    local processes: the same stages on the same ports, the same flags (NOT_COMPARED aside),
    the same pool kinds."""
    d = up_deployment(["--disagg"])
    assert d is not None, "`tandem up` rejects --disagg"
    up_stages: dict[str, list[Any]] = {}
    for p in processes(d, tmp_path):
        stage, config = parse_serve(["tandem", *p.argv[3:]])
        up_stages.setdefault(stage, []).append(config)
    compose = by_profile(load_compose(), "cpu")
    assert set(up_stages) == set(compose), "stages differ from `tandem up --disagg`"
    for stage, configs in up_stages.items():
        _, ours = compose[stage]
        assert grpc_port(ours) in {grpc_port(c) for c in configs}, f"{stage} port"
        for theirs in configs:
            assert _comparable(theirs) == _comparable(ours), stage
    _, router = compose["router"]
    # The encode, video and embedding pools stay empty unless their profiles run (`tandem up`
    # adds them only when asked, e.g. --encode-ports).
    assert sorted(p.kind for p in up_stages["router"][0].resolved_pools()) == sorted(
        p.kind for p in router.resolved_pools() if p.kind not in OWN_PROFILE_POOLS)
    assert up_stages["frontend"][0].router_address.rpartition(":")[2] == str(router.port)
    assert compose["frontend"][1].router_address.rpartition(":")[2] == str(router.port)
