"""Typed layered config: defaults < YAML < environment < flags, and the launcher's process
list."""
from __future__ import annotations

import argparse
import pathlib
from dataclasses import dataclass, field

import pytest
import yaml

from tandem.errors import InvalidRequest
from tandem.launcher.deployment import Deployment
from tandem.launcher.processes import processes
from tandem.routing.config import RouterConfig
from tandem.runtime import config as config_lib
from tandem.runtime.worker_config import WorkerConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_defaults_then_yaml_then_flags(tmp_path: pathlib.Path) -> None:
    yaml_file = tmp_path / "worker.yaml"
    yaml_file.write_text("port: 9999\nengine_args:\n  kv_block_size: 16\n  max_batch_size: 8\n")
    config = config_lib.load(WorkerConfig, ["--config", str(yaml_file), "--max-batch-size", "4"],
                             prog="t")
    assert config.port == 9999                        # YAML over default
    assert config.engine_args.kv_block_size == 16     # nested YAML
    assert config.engine_args.max_batch_size == 4     # flag over YAML
    assert config.engine_args.max_num_tokens == 4096  # default kept
    assert config.host == "127.0.0.1"


def test_flag_names_follow_dynamo() -> None:
    config = config_lib.load(WorkerConfig, ["--num-gpu-blocks-override", "7", "--no-publish-kv-events",
                                            "--model", "/m", "--speedup-ratio", "0"], prog="t")
    assert config.engine_args.num_gpu_blocks == 7
    assert config.publish_kv_events is False
    assert config.engine_args.model == "/m" and config.engine_args.speedup_ratio == 0.0


@pytest.mark.parametrize("text,key", [("prot: 1\n", "prot"),
                                      ("engine_args:\n  kv_blok_size: 3\n",
                                       "engine_args.kv_blok_size"),
                                      ("port: seven\n", "port")])
def test_bad_yaml_names_the_key(tmp_path: pathlib.Path, text: str, key: str) -> None:
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text(text)
    with pytest.raises(InvalidRequest) as info:
        config_lib.load(WorkerConfig, ["--config", str(yaml_file)], prog="t")
    assert key in info.value.message


def test_to_argv_round_trips_non_defaults() -> None:
    config = config_lib.load(WorkerConfig, ["--port", "1234", "--kv-block-size", "64",
                                            "--no-enable-prefix-caching"], prog="t")
    again = config_lib.load(WorkerConfig, config_lib.to_argv(config), prog="t")
    assert again == config


def _router_yaml(argv: list[str]) -> dict:
    return yaml.safe_load(pathlib.Path(argv[argv.index("--config") + 1]).read_text())


def test_shipped_deployment_file_loads_and_wires_the_topology(tmp_path: pathlib.Path) -> None:
    # One frontend process named (0 would be one per 4 cores: several on a larger machine).
    d = config_lib.load(Deployment, ["--config", str(ROOT / "deploy/local.yaml"),
                                     "--decode-ports", "9300", "9301",
                                     "--frontend-processes", "1"], prog="t")
    procs = processes(d, tmp_path)
    assert [p.name for p in procs] == ["decode-0", "decode-1", "router", "frontend"]
    routed = _router_yaml(procs[2].argv)
    assert routed["pools"] == [{"name": "decode", "kind": "decode", "policy": "round_robin",
                                "workers": ["127.0.0.1:9300", "127.0.0.1:9301"]}]
    assert config_lib.build(RouterConfig, routed).resolved_pools()[0].workers == [
        "127.0.0.1:9300", "127.0.0.1:9301"]
    frontend = procs[3].argv
    assert frontend[frontend.index("--router-address") + 1] == "127.0.0.1:9100"
    assert all("--speedup-ratio" not in p.argv for p in procs[:2])  # 1.0 is the default
    decode = procs[0].argv
    assert decode[decode.index("--engine") + 1] == "reference"


def test_multi_pool_deployment(tmp_path: pathlib.Path) -> None:
    grid = tmp_path / "grid.json"
    grid.write_text("{}")
    spec = tmp_path / "deploy.yaml"
    spec.write_text(
        "engine: mock\n"
        f"grid_config: {grid}\n"
        "pools:\n"
        "  - {name: fast, kind: agg, ports: [9400], policy: kv, worker_flags: [--speedup-ratio, '0']}\n"
        "  - {name: slow, kind: agg, ports: [9401, 9402]}\n")
    procs = processes(config_lib.load(Deployment, ["--config", str(spec)], prog="t"), tmp_path)
    assert [p.name for p in procs] == ["fast-0", "slow-0", "slow-1", "router", "frontend"]
    assert procs[0].argv[-2:] == ["--speedup-ratio", "0"]
    routed = _router_yaml(procs[3].argv)
    assert [(p["name"], p["kind"], p["policy"], p["workers"]) for p in routed["pools"]] == [
        ("fast", "agg", "kv", ["127.0.0.1:9400"]),
        ("slow", "agg", "round_robin", ["127.0.0.1:9401", "127.0.0.1:9402"])]
    assert routed["grid_config"] == str(grid.resolve())


def test_worker_metrics_ports_go_to_the_workers_in_start_order(tmp_path: pathlib.Path) -> None:
    d = config_lib.load(Deployment, ["--disagg", "--decode-ports", "9200", "9201",
                                     "--prefill-ports", "9300", "--worker-metrics-ports",
                                     "9400", "9401", "9402"], prog="t")
    procs = processes(d, tmp_path)
    ports = {p.name: p.argv[p.argv.index("--metrics-port") + 1] for p in procs
             if "--metrics-port" in p.argv}
    assert ports == {"decode-0": "9400", "decode-1": "9401", "prefill-0": "9402"}
    with pytest.raises(InvalidRequest, match="2 ports for 3 workers"):
        processes(config_lib.load(Deployment, [
            "--disagg", "--decode-ports", "9200", "9201", "--worker-metrics-ports", "1", "2"],
            prog="t"), tmp_path)


def test_shipped_deployment_file_is_the_defaults_written_out() -> None:
    d = config_lib.load(Deployment, ["--config", str(ROOT / "deploy/local.yaml")], prog="t")
    assert d == Deployment()
    assert d.engine == "reference"


@dataclass(frozen=True)
class Pool:
    name: str = ""
    ports: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Topo:
    pools: list[Pool] = field(default_factory=list)


def test_lists_of_structured_entries_come_from_yaml(tmp_path: pathlib.Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("pools:\n  - {name: a, ports: [1, 2]}\n  - {name: b}\n")
    assert config_lib.load(Topo, ["--config", str(good)], prog="t").pools == [
        Pool("a", [1, 2]), Pool("b", [])]
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - {name: a, portz: [1]}\n")
    with pytest.raises(InvalidRequest, match=r"pools\[0\]\.portz"):
        config_lib.load(Topo, ["--config", str(bad)], prog="t")


def test_shipped_sla_pools_example_builds_a_router(tmp_path: pathlib.Path) -> None:
    from tandem.routing.grid_config import read_grid_config_file
    from tandem.routing.router import Router

    d = config_lib.load(Deployment, ["--config", str(ROOT / "deploy/sla-pools.yaml")], prog="t")
    procs = processes(d, tmp_path)
    assert [p.name for p in procs][:4] == ["fast-0", "fast-1", "bulk-0", "bulk-1"]
    routed = config_lib.build(RouterConfig, _router_yaml(procs[4].argv))
    grid = read_grid_config_file(str(ROOT / "deploy/sla-grid.json"))
    router = Router(routed.resolved_pools(), grid, routed.block_size, routed.typical_osl)
    assert [p.name for p in router.pools] == ["fast", "bulk"]


def test_encode_ports_add_an_encode_pool_and_the_frontend_gets_block_size_and_media(
        tmp_path: pathlib.Path) -> None:
    d = config_lib.load(Deployment, [
        "--disagg", "--encode-ports", "9500", "9501", "--kv-block-size", "16",
        "--allowed-media-networks", "127.0.0.0/8", "10.0.0.0/8", "--max-file-size-mb", "5"],
        prog="t")
    procs = processes(d, tmp_path)
    assert [p.name for p in procs] == ["decode-0", "prefill-0", "encode-0", "encode-1", "router",
                                       "frontend"]
    encode = procs[2].argv
    assert encode[encode.index("serve") + 1] == "encode"
    assert encode[encode.index("--kv-block-size") + 1] == "16"
    routed = _router_yaml(procs[4].argv)
    assert routed["pools"][-1] == {"name": "encode", "kind": "encode", "policy": "round_robin",
                                   "workers": ["127.0.0.1:9500", "127.0.0.1:9501"]}
    frontend_argv = procs[5].argv
    from services.frontend.config import FrontendConfig

    frontend = config_lib.load(FrontendConfig, frontend_argv[frontend_argv.index("frontend") + 1:],
                               prog="t")
    assert frontend.kv_block_size == 16
    assert frontend.media.allowed_media_networks == ("127.0.0.0/8", "10.0.0.0/8")
    assert frontend.media.max_file_size_mb == 5.0
    # The mock engine has no vision encoder: refused before anything starts.
    with pytest.raises(InvalidRequest, match="mock engine"):
        processes(config_lib.load(Deployment, ["--engine", "mock", "--encode-ports", "9500"],
                                  prog="t"), tmp_path)


def test_environment_sits_between_yaml_and_flags(tmp_path: pathlib.Path) -> None:
    yaml_file = tmp_path / "up.yaml"
    yaml_file.write_text("http_port: 1\ngrpc_port: 2\ndecode_ports: [3]\n")
    environ = {"TANDEM_HTTP_PORT": "8080", "TANDEM_GRPC_PORT": "8081",
               "TANDEM_DECODE_PORTS": "9201, 9202 9203", "TANDEM_TLS_CERT_FILE": "/s/cert.pem",
               "TANDEM_TLS_KEY_FILE": "/s/key.pem", "TANDEM_TLS_CA_FILE": "/s/ca.pem",
               "TANDEM_TLS_REQUIRE_CLIENT_CERT": "yes", "TANDEM_DEBUG_HOOKS": "",
               "TANDEM_UNRELATED": "x"}
    d = config_lib.load(Deployment, ["--config", str(yaml_file), "--grpc-port", "7"], prog="t",
                        environ=environ)
    assert d.http_port == 8080                   # environment over YAML
    assert d.grpc_port == 7                      # flag over environment
    assert d.decode_ports == [9201, 9202, 9203]  # a list, commas or spaces
    assert (d.tls.cert_file, d.tls.key_file, d.tls.ca_file) == ("/s/cert.pem", "/s/key.pem",
                                                                "/s/ca.pem")
    assert d.tls.require_client_cert is True     # nested config, boolean words
    assert d.debug_hooks is False                # empty: unset


@pytest.mark.parametrize("var,value", [("TANDEM_PORT", "seven"), ("TANDEM_DEBUG_HOOKS", "maybe"),
                                       ("TANDEM_SPEEDUP_RATIO", "fast")])
def test_a_bad_environment_value_names_the_variable(var: str, value: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        config_lib.load(WorkerConfig, [], prog="t", environ={var: value})
    assert info.value.message.startswith(f"${var} must be") and value in info.value.message


def test_api_keys_keep_their_own_variable() -> None:
    # $TANDEM_API_KEYS is added to the keys by the frontend itself (tandem.frontend.auth), never
    # read as the --api-keys field, which would log it.
    from services.frontend.config import FrontendConfig

    config = config_lib.load(FrontendConfig, [], prog="t", environ={"TANDEM_API_KEYS": "k1"})
    assert config.api_keys == []
    parser = argparse.ArgumentParser()
    config_lib.add_arguments(parser, FrontendConfig)
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    assert "[env TANDEM_TLS_CERT_FILE]" in helps["--tls-cert-file"]
    assert "env" not in helps.get("--api-keys", "")
