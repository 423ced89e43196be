"""deploy/compose/tls.yaml's settings on real processes: a decode worker, a router and a frontend,
each started with the TANDEM_TLS_* variables the override gives its Compose service and the
certificate deploy/compose/make-certs.sh writes. Each one's container health check passes; the
services reach each other over mTLS verifying the shared name `tandem` (they dial 127.0.0.1); the
official openai client reaches HTTPS and a gRPC client without a certificate the public port;
an internal port refuses that client."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.topology import ROOT, START_TIMEOUT_S, free_ports, tandem_cmd, terminate_all

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
OVERRIDE = ROOT / "deploy" / "compose" / "tls.yaml"
HEALTH_SCRIPT = ROOT / "deploy" / "docker" / "grpc_health_check.py"


def service_environ(service: str, certs: pathlib.Path) -> dict[str, str]:
    """The override's variables for `service`, its secrets where make-certs.sh wrote them."""
    override = yaml.safe_load(OVERRIDE.read_text())
    files = {f"/run/secrets/{name}": str(certs / pathlib.Path(s["file"]).name)
             for name, s in override["secrets"].items()}
    environ = {}
    for key, value in override["services"][service]["environment"].items():
        value = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))  # Compose's defaults
        environ[key] = files.get(value, value)
    return environ


def health_check(address: str, service: str, environ: dict[str, str]) -> int:
    return subprocess.run([sys.executable, str(HEALTH_SCRIPT), address, "--service", service],
                          env=environ, capture_output=True, timeout=30).returncode


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[pathlib.Path, int, int, str]]:
    """(certificate directory, HTTPS port, public gRPC port, decode worker address)."""
    certs = tmp_path_factory.mktemp("certs")
    # Not 127.0.0.1, which the services dial: only the shared name lets them verify each other.
    subprocess.run(["bash", str(ROOT / "deploy/compose/make-certs.sh"), str(certs), "tandem",
                    "localhost"], check=True, capture_output=True)
    decode, router, http, grpc_port = free_ports(4)
    plan = [
        ("decode-cpu", f"127.0.0.1:{decode}", "tandem.v1.Decode",
         ["serve", "decode", "--engine", "mock", "--port", str(decode)]),
        ("router-cpu", f"127.0.0.1:{router}", "tandem.v1.Router",
         ["serve", "router", "--port", str(router), "--decode-workers", f"127.0.0.1:{decode}"]),
        ("frontend-cpu", f"127.0.0.1:{grpc_port}", "tandem.v1.Inference",
         ["serve", "frontend", "--http-port", str(http), "--grpc-port", str(grpc_port),
          "--router-address", f"127.0.0.1:{router}"]),
    ]
    procs = []
    try:
        for service, address, health_name, argv in plan:
            environ = {**os.environ, **service_environ(service, certs)}
            procs.append(subprocess.Popen(tandem_cmd(*argv), cwd=ROOT, env=environ))
            deadline = time.monotonic() + START_TIMEOUT_S
            while health_check(address, health_name, environ) != 0:  # the container's check
                assert procs[-1].poll() is None, f"{service} exited"
                assert time.monotonic() < deadline, f"{service} never reported SERVING"
                time.sleep(0.5)
        yield certs, http, grpc_port, f"127.0.0.1:{decode}"
    finally:
        terminate_all(procs)


def test_clients_reach_the_public_ports_and_services_each_other(
        services: tuple[pathlib.Path, int, int, str]) -> None:
    certs, http, grpc_port, _ = services
    ca = certs / "ca.pem"
    client = openai.OpenAI(base_url=f"https://localhost:{http}/v1", api_key="unused",
                           max_retries=0, http_client=openai.DefaultHttpxClient(
                               verify=ssl.create_default_context(cafile=str(ca))))
    reply = client.completions.create(model="tandem-demo", prompt="Hello", max_tokens=3)
    # Frontend -> router -> decode worker, each hop over mTLS under the name "tandem".
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    with grpc.secure_channel(f"localhost:{grpc_port}", credentials) as channel:  # no cert
        models = inference_pb2_grpc.InferenceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), timeout=10)
    assert [m.id for m in models.models] == ["tandem-demo"]


def test_internal_ports_refuse_clients_without_a_certificate(
        services: tuple[pathlib.Path, int, int, str]) -> None:
    certs, _, _, decode = services
    credentials = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    options = [("grpc.ssl_target_name_override", "tandem")]
    with grpc.secure_channel(decode, credentials, options=options) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
