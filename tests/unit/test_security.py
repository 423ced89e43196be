"""API keys, the TLS config block and request limits: parsing, the REST middleware, the gRPC
check, and how `tandem up` hands the config to every service."""
from __future__ import annotations

import pathlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.frontend.config import FrontendConfig
from services.frontend.http_app import api_key_auth, json_errors
from services.frontend.inference import InferenceServicer
from tandem.errors import InvalidRequest, Unauthenticated
from tandem.frontend.auth import ENV_VAR, ApiKeys
from tandem.frontend.frontend import Frontend, ModelInfo
from tandem.frontend.openai_request import parse_request
from tandem.frontend.pipeline import Pipeline
from tandem.frontend.served_models import ServedModels
from tandem.frontend.tokenizer import Tokenizer
from tandem.launcher.deployment import Deployment
from tandem.launcher.processes import processes
from tandem.model.demo import ensure_demo_model
from tandem.routing.config import RouterConfig
from tandem.runtime import config as config_lib
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.runtime.tls import TlsConfig, http_ssl_context
from tandem.runtime.worker_config import WorkerConfig

TLS_FLAGS = ["--tls-cert-file", "s.pem", "--tls-key-file", "s.key", "--tls-ca-file", "ca.pem",
             "--tls-require-client-cert"]
MTLS = TlsConfig("s.pem", "s.key", "ca.pem", True)


# --- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [FrontendConfig, RouterConfig, WorkerConfig])
def test_every_service_takes_the_same_tls_flags(cls: type) -> None:
    config = config_lib.load(cls, TLS_FLAGS, prog="t")
    assert config.tls == MTLS
    assert config_lib.load(cls, [], prog="t").tls == TlsConfig()
    assert not TlsConfig().enabled


def test_tls_from_yaml_and_back_to_flags(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("tls:\n  cert_file: s.pem\n  key_file: s.key\n  ca_file: ca.pem\n"
                    "  require_client_cert: true\n")
    config = config_lib.load(WorkerConfig, ["--config", str(file)], prog="t")
    assert config.tls == MTLS
    assert config_lib.to_argv(config.tls) == TLS_FLAGS


@pytest.mark.parametrize(("flags", "message"), [
    (["--tls-cert-file", "s.pem"], "go together"),
    (["--tls-key-file", "s.key"], "go together"),
    (["--tls-cert-file", "s.pem", "--tls-key-file", "s.key", "--tls-require-client-cert"],
     "needs"),
])
def test_incomplete_tls_config_is_refused(flags: list[str], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        config_lib.load(WorkerConfig, flags, prog="t")


async def test_missing_certificate_files_are_named() -> None:
    tls = TlsConfig("/nonexistent/s.pem", "/nonexistent/s.key")
    with pytest.raises(InvalidRequest, match="/nonexistent/s.pem"):
        http_ssl_context(tls)
    with pytest.raises(InvalidRequest, match="/nonexistent/s"):
        GrpcService(ServerOptions(port=0, tls=tls), [])


def test_limits_are_flags() -> None:
    config = config_lib.load(FrontendConfig, ["--max-messages", "7", "--max-message-bytes", "1024",
                                              "--max-request-bytes", "2048"], prog="t")
    assert (config.max_messages, config.max_message_bytes, config.max_request_bytes) == (
        7, 1024, 2048)
    assert config_lib.load(WorkerConfig, ["--max-message-bytes", "9"], prog="t"
                           ).max_message_bytes == 9
    assert config_lib.load(RouterConfig, ["--max-message-bytes", "9"], prog="t"
                           ).max_message_bytes == 9


def test_api_keys_never_reach_the_log_line() -> None:
    config = config_lib.load(FrontendConfig, ["--api-keys", "sk-one", "sk-two"], prog="t")
    assert config.api_keys == ["sk-one", "sk-two"]
    logged = config_lib.as_dict(config)
    assert logged["api_keys"] == "<redacted>" and "sk-one" not in repr(logged)
    assert config_lib.as_dict(FrontendConfig())["api_keys"] == []


def test_tandem_up_passes_tls_to_every_service_and_keys_to_the_frontend(
        tmp_path: pathlib.Path) -> None:
    d = Deployment(engine="mock", disagg=True, tls=MTLS, api_keys=["sk-1"],
                   api_keys_file="keys.txt")
    services = processes(d, tmp_path)
    assert {s.name for s in services} == {"decode-0", "prefill-0", "router", "frontend"}
    for service in services:
        argv = " ".join(service.argv)
        assert " ".join(TLS_FLAGS) in argv, service.name
        assert ("--api-keys sk-1" in argv) == (service.name == "frontend")
        assert ("--api-keys-file" in argv) == (service.name == "frontend")
    plain = processes(Deployment(engine="mock"), tmp_path)
    assert not any("--tls" in " ".join(s.argv) for s in plain)


# --- API keys -------------------------------------------------------------------------------

def test_keys_come_from_flags_file_and_environment(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "keys"
    file.write_text("# comment\nsk-file\n\n  sk-file2  \n")
    keys = ApiKeys.load(["sk-flag"], str(file), {ENV_VAR: "sk-env1, sk-env2"})
    assert keys.num_keys == 5
    for key in ("sk-flag", "sk-file", "sk-file2", "sk-env1", "sk-env2"):
        keys.check(f"Bearer {key}")
    keys.check("bearer sk-flag")  # the scheme is case-insensitive (RFC 9110)
    with pytest.raises(Unauthenticated):
        keys.check("Bearer # comment")
    with pytest.raises(InvalidRequest, match="api-keys-file"):
        ApiKeys.load([], str(tmp_path / "missing"), {})


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic sk-1", "Bearer sk-2",
                                    "sk-1", "Bearer sk-1x"])
def test_anything_but_a_known_bearer_key_is_refused(header: str | None) -> None:
    with pytest.raises(Unauthenticated):
        ApiKeys(["sk-1"]).check(header)


def test_no_keys_means_no_authentication() -> None:
    keys = ApiKeys.load([], "", {})
    assert not keys.enabled
    keys.check(None)
    keys.check("Bearer anything")


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[json_errors, api_key_auth(ApiKeys(["sk-right"]))])
    for path in ("/v1/models", "/health", "/live", "/metrics"):
        app.router.add_get(path, ok)
    app.router.add_post("/v1/chat/completions", ok)
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"},
                                     {"Authorization": "sk-right"}])
async def test_rest_api_without_the_key_is_401_in_openai_shape(
        client: TestClient, headers: dict[str, str]) -> None:
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/nowhere")):
        response = await client.request(method, path, headers=headers, json={})
        assert response.status == 401, path
        assert response.headers["WWW-Authenticate"] == "Bearer"
        error = (await response.json())["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert error["message"] and error["param"] is None


async def test_rest_api_with_the_key_passes(client: TestClient) -> None:
    auth = {"Authorization": "Bearer sk-right"}
    response = await client.post("/v1/chat/completions", headers=auth, json={})
    assert response.status == 200 and await response.json() == {"ok": True}
    assert (await client.get("/nowhere", headers=auth)).status == 404  # past auth, to routing


@pytest.mark.parametrize("path", ["/health", "/live", "/metrics"])
async def test_probes_and_metrics_stay_open(client: TestClient, path: str) -> None:
    assert (await client.get(path)).status == 200


class _Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


@pytest.mark.parametrize(("metadata", "passes"), [
    ((), False),
    ((("authorization", "Bearer sk-wrong"),), False),
    ((("x-request-id", "r"), ("authorization", "Bearer sk-right")), True),
])
async def test_grpc_inference_checks_the_authorization_metadata(
        metadata: tuple[tuple[str, str], ...], passes: bool) -> None:
    frontend = cast(Frontend, type("F", (), {"model": ModelInfo("demo", 64)})())
    servicer = InferenceServicer(ServedModels([frontend]), cast(Any, None), ApiKeys(["sk-right"]))
    context = cast(Any, _Context(metadata))
    if passes:
        reply = await servicer.ListModels(cast(Any, None), context)
        assert reply.models[0].id == "demo"
    else:
        with pytest.raises(Unauthenticated):
            await servicer.ListModels(cast(Any, None), context)


# --- request limits ------------------------------------------------------------------------

async def test_more_messages_than_the_limit_is_400() -> None:
    tokenizer = Tokenizer.from_dir(ensure_demo_model())
    frontend = Frontend(ModelInfo("demo", 100_000), tokenizer, cast(Pipeline, None),
                        max_messages=3)
    chat = [{"role": "user", "content": "hi"}] * 4
    with pytest.raises(InvalidRequest, match="at most 3 messages") as info:
        await frontend.prepare(parse_request({"model": "demo", "messages": chat}, "chat"))
    assert info.value.param == "messages"
    prepared = await frontend.prepare(parse_request({"model": "demo", "messages": chat[:3]},
                                                    "chat"))
    assert prepared.prompt_token_ids


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_https_port_asks_client_certificates_exactly_under_mtls(tmp_path: pathlib.Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "c.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=t"], check=True, capture_output=True)
    tls = TlsConfig(str(cert), str(key), str(cert))
    mtls = TlsConfig(str(cert), str(key), str(cert), require_client_cert=True)
    modes = [(context := http_ssl_context(c, ask)) is not None and context.verify_mode
             for c, ask in ((tls, True), (mtls, True), (mtls, False))]
    assert modes == [ssl.CERT_NONE, ssl.CERT_REQUIRED, ssl.CERT_NONE]
