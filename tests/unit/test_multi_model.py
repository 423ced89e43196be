"""Several models in one deployment: the launcher gives each model its pools (named after it)
and a router of its own, and hands the frontend a file listing them; the frontend refuses a
model listed without a name or router, or twice; metrics of all models share one registry,
each under its label."""
from __future__ import annotations

import pathlib

import pytest
import yaml
from prometheus_client import generate_latest

from services.frontend.config import FrontendConfig
from services.frontend.main import served_models
from tandem.errors import InvalidRequest
from tandem.frontend.metrics import FrontendMetrics
from tandem.launcher.deployment import Deployment
from tandem.launcher.processes import processes
from tandem.runtime import config as config_lib

DEPLOYMENT = {"router_port": 9500, "models": [
    {"name": "alpha", "pools": [{"name": "decode", "kind": "decode", "ports": [9601],
                                 "policy": "kv"}]},
    {"name": "beta", "model": "/models/beta", "tool_call_parser": "hermes",
     "worker_flags": ["--max-num-seqs", "8"],
     "pools": [{"name": "decode", "kind": "decode", "ports": [9602]},
               {"name": "prefill", "kind": "prefill", "ports": [9603]}]}]}


def load(cls: type, tmp_path: pathlib.Path, content: object) -> object:
    path = tmp_path / f"{cls.__name__}.yaml"
    path.write_text(yaml.safe_dump(content))
    return config_lib.load(cls, ["--config", str(path)], prog="test")


def test_each_model_gets_its_pools_and_router(tmp_path: pathlib.Path) -> None:
    d = load(Deployment, tmp_path, DEPLOYMENT)
    by_name = {p.name: p for p in processes(d, tmp_path)}  # type: ignore[arg-type]
    assert list(by_name) == ["alpha-decode-0", "beta-decode-0", "beta-prefill-0", "router-alpha",
                             "router-beta", "frontend"]
    beta = by_name["beta-decode-0"].argv
    assert beta[beta.index("--model") + 1] == "/models/beta"
    assert beta[beta.index("--disaggregation-mode") + 1] == "decode"
    assert beta[beta.index("--max-num-seqs") + 1] == "8"
    alpha = by_name["alpha-decode-0"].argv
    assert "--model" not in alpha and alpha[alpha.index("--disaggregation-mode") + 1] == "agg"
    assert by_name["router-beta"].health_address == "127.0.0.1:9501"
    router = yaml.safe_load((tmp_path / "router-beta.yaml").read_text())
    assert [(p["name"], p["workers"]) for p in router["pools"]] == [
        ("beta-decode", ["127.0.0.1:9602"]), ("beta-prefill", ["127.0.0.1:9603"])]
    argv = by_name["frontend"].argv
    frontend = config_lib.load(FrontendConfig, argv[argv.index("--config"):argv.index(
        "--config") + 2], prog="test")
    assert [(m.name, m.model, m.router_address, m.tool_call_parser)
            for m in served_models(frontend)] == [
        ("alpha", "", "127.0.0.1:9500", ""), ("beta", "/models/beta", "127.0.0.1:9501", "hermes")]


@pytest.mark.parametrize("models, param", [
    ([{"name": "", "router_address": "a:1"}], "models[0].name"),
    ([{"name": "a"}], "models[0].router_address"),
    ([{"name": "a", "router_address": "a:1"}, {"name": "a", "router_address": "a:2"}],
     "models[1].name"),
])
def test_the_frontend_refuses_an_incomplete_model_list(tmp_path: pathlib.Path, models: object,
                                                       param: str) -> None:
    config = load(FrontendConfig, tmp_path, {"models": models})
    with pytest.raises(InvalidRequest) as info:
        served_models(config)  # type: ignore[arg-type]
    assert info.value.param == param


def test_a_deployment_refuses_a_model_without_pools_or_twice(tmp_path: pathlib.Path) -> None:
    for models, param in (([{"name": "a"}], "models[0]"),
                          ([DEPLOYMENT["models"][0]] * 2, "models[1].name")):  # type: ignore[index]
        d = load(Deployment, tmp_path, {"models": models})
        with pytest.raises(InvalidRequest) as info:
            processes(d, tmp_path)  # type: ignore[arg-type]
        assert info.value.param == param


def test_models_share_one_registry_under_their_labels() -> None:
    alpha = FrontendMetrics("alpha")
    beta = alpha.for_model("beta")
    assert beta.registry is alpha.registry
    tracker = alpha.track("chat_completions")
    tracker.relabel(beta)  # the body named beta
    tracker.finish("200")
    text = generate_latest(alpha.registry).decode()
    assert 'tandem_frontend_inflight_requests{model="alpha"} 0.0' in text
    assert 'tandem_frontend_inflight_requests{model="beta"} 0.0' in text
    for name in ("alpha", "beta"):  # at 0 before any router outage
        assert f'tandem_frontend_router_fallback{{model="{name}"}} 0.0' in text
        assert f'tandem_frontend_fallback_routes_total{{model="{name}"}} 0.0' in text
    assert 'tandem_frontend_requests_total{endpoint="chat_completions",model="beta",' \
           'status="200"} 1.0' in text


def test_an_embedding_model_beside_the_text_model_shares_its_router(
        tmp_path: pathlib.Path) -> None:
    # compose and Kubernetes: one router, its embedding pool beside the text pools.
    config = load(FrontendConfig, tmp_path, {"router_address": "dns:router:9100",
                                             "embedding_model": "embed",
                                             "embedding_model_path": "/embed-model"})
    text, embed = served_models(config)  # type: ignore[arg-type]
    assert (text.kind, embed.kind) == ("text", "embedding")
    assert (embed.name, embed.model, embed.router_address) == (
        "embed", "/embed-model", "dns:router:9100")
    config = load(FrontendConfig, tmp_path, {"embedding_model": "embed"})
    with pytest.raises(InvalidRequest) as info:
        served_models(config)  # type: ignore[arg-type]
    assert info.value.param == "embedding_model_path"
