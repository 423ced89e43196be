"""TLS, mTLS and API keys on real processes: a throwaway PKI made with the `openssl` binary, a
mock-engine worker behind TLS or mTLS, and a whole `tandem up` topology over mTLS with an API
key on the frontend, reached by the official `openai` client and the gRPC Inference API."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.topology import (
    ROOT,
    START_TIMEOUT_S,
    Topology,
    free_ports,
    start_topology,
    tandem_cmd,
    terminate_all,
)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
API_KEY = "sk-tandem-test"
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class Pki:
    ca: pathlib.Path
    #: Signed by `ca`; names localhost and 127.0.0.1. Services present it as server and client.
    server: tuple[pathlib.Path, pathlib.Path]
    #: A client certificate signed by `ca`.
    client: tuple[pathlib.Path, pathlib.Path]
    #: A client certificate from another CA.
    rogue: tuple[pathlib.Path, pathlib.Path]

    def read(self, pair: tuple[pathlib.Path, pathlib.Path] | None) -> dict[str, bytes | None]:
        cert, key = pair or (None, None)
        return {"root_certificates": self.ca.read_bytes(),
                "certificate_chain": cert.read_bytes() if cert else None,
                "private_key": key.read_bytes() if key else None}


def _openssl(*args: str | pathlib.Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _ca(d: pathlib.Path, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", key, "-out", cert, "-days", "1", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _leaf(d: pathlib.Path, name: str, ca: tuple[pathlib.Path, pathlib.Path]
          ) -> tuple[pathlib.Path, pathlib.Path]:
    cert, key, csr, ext = (d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr",
                           d / f"{name}.ext")
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", cert, "-days", "1", "-extfile", ext)
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = _ca(d, "ca"), _ca(d, "other-ca")
    return Pki(ca[0], _leaf(d, "server", ca), _leaf(d, "client", ca),
               _leaf(d, "rogue", other_ca))


def _tls_flags(pki: Pki, mtls: bool) -> list[str]:
    return ["--tls-cert-file", str(pki.server[0]), "--tls-key-file", str(pki.server[1]),
            "--tls-ca-file", str(pki.ca), *(["--tls-require-client-cert"] if mtls else [])]


def _tls_environ(pki: Pki) -> dict[str, str]:
    return {"TANDEM_TLS_CERT_FILE": str(pki.server[0]), "TANDEM_TLS_KEY_FILE": str(pki.server[1]),
            "TANDEM_TLS_CA_FILE": str(pki.ca)}


def _health(channel: grpc.Channel, wait: bool = False) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), wait_for_ready=wait,
                      timeout=START_TIMEOUT_S if wait else 5).status


def _secure(address: str, pki: Pki, cert: tuple[pathlib.Path, pathlib.Path] | None,
            trust_ca: bool = True) -> grpc.Channel:
    creds = pki.read(cert)
    if not trust_ca:
        creds["root_certificates"] = None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(**creds))


def _refused(channel: grpc.Channel) -> None:
    with channel, pytest.raises(grpc.RpcError) as info:
        _health(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def workers(pki: Pki) -> Iterator[tuple[str, str]]:
    """(TLS worker, mTLS worker) addresses: `tandem serve decode --engine mock` each."""
    ports = free_ports(2)
    procs = [subprocess.Popen(tandem_cmd("serve", "decode", "--engine", "mock", "--port",
                                         str(port), *_tls_flags(pki, mtls)), cwd=ROOT)
             for port, mtls in zip(ports, (False, True))]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    try:
        for address in addresses:
            with _secure(address, pki, pki.client) as channel:
                assert _health(channel, wait=True) == SERVING
        yield addresses[0], addresses[1]
    finally:
        terminate_all(procs)


def test_tls_worker_refuses_plaintext_and_unverified_clients(
        pki: Pki, workers: tuple[str, str]) -> None:
    address = workers[0]
    _refused(grpc.insecure_channel(address))
    _refused(_secure(address, pki, None, trust_ca=False))  # system roots do not know our CA
    with _secure(address, pki, None) as channel:  # no client certificate needed without mTLS
        assert _health(channel) == SERVING


def test_mtls_worker_refuses_clients_without_a_trusted_certificate(
        pki: Pki, workers: tuple[str, str]) -> None:
    address = workers[1]
    _refused(grpc.insecure_channel(address))
    _refused(_secure(address, pki, None))
    _refused(_secure(address, pki, pki.rogue))
    with _secure(address, pki, pki.client) as channel:
        assert _health(channel) == SERVING


def test_container_health_check_speaks_tls_from_the_services_environment(
        pki: Pki, workers: tuple[str, str]) -> None:
    script = ROOT / "deploy" / "docker" / "grpc_health_check.py"

    def check(address: str, environ: dict[str, str]) -> int:
        return subprocess.run([sys.executable, str(script), address, "--service",
                               "tandem.v1.Decode", "--timeout-s", "10"], capture_output=True,
                              env={**os.environ, **environ}, timeout=60).returncode

    for address in workers:  # TLS, then mTLS (the health check presents the certificate)
        assert check(address, _tls_environ(pki)) == 0
        assert check(address, {}) == 1  # plaintext to a TLS port
        # The certificate names localhost, not the address's host: verified under another name.
        assert check(address.replace("127.0.0.1", "localhost"),
                     _tls_environ(pki) | {"TANDEM_TLS_SERVER_NAME": "localhost"}) == 0
        assert check(address, _tls_environ(pki) | {"TANDEM_TLS_SERVER_NAME": "other"}) == 1


def _first_bytes(address: str, pki: Pki, cert: tuple[pathlib.Path, pathlib.Path] | None
                 ) -> bytes:
    """What the server answers an HTTP/2 preface with over raw TLS; b"" when it hung up."""
    context = ssl.create_default_context(cafile=pki.ca)
    context.set_alpn_protocols(["h2"])
    if cert is not None:
        context.load_cert_chain(*cert)
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                # TLS 1.3: the server judges the client certificate after the client's side
                # of the handshake finished; its refusal shows on the first read.
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                return tls.recv(64)
        except (ssl.SSLError, ConnectionResetError):
            return b""


def test_mtls_handshake_is_refused_at_the_tls_layer(pki: Pki, workers: tuple[str, str]) -> None:
    address = workers[1]
    assert _first_bytes(address, pki, pki.client)  # the server's HTTP/2 SETTINGS
    assert _first_bytes(address, pki, None) == b""
    assert _first_bytes(address, pki, pki.rogue) == b""


@pytest.fixture(scope="module")
def secure_topology(pki: Pki) -> Iterator[Topology]:
    """`tandem up` with mTLS on every gRPC port, TLS on HTTP, and an API key on the frontend.
    All of it from the environment, as Compose and Kubernetes set it (the worker fixture above
    uses the flags)."""
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", env=_tls_environ(pki) | {
        "TANDEM_TLS_REQUIRE_CLIENT_CERT": "true", "TANDEM_API_KEYS": API_KEY})
    try:
        yield topo
    finally:
        assert topo.stop() == 0


def _https(pki: Pki, cert: tuple[pathlib.Path, pathlib.Path] | None) -> ssl.SSLContext:
    """A client context that trusts the test CA and presents `cert` (none: no certificate)."""
    context = ssl.create_default_context(cafile=pki.ca)
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


def _openai(url: str, pki: Pki, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=_https(pki, pki.client)))


def test_openai_client_needs_the_api_key(pki: Pki, secure_topology: Topology) -> None:
    url, model = secure_topology.http_url, secure_topology.model
    assert url.startswith("https://")
    messages = [{"role": "user", "content": "Hello"}]
    with pytest.raises(openai.AuthenticationError) as info:
        _openai(url, pki, "sk-wrong").chat.completions.create(model=model, messages=messages,
                                                              max_tokens=4)
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _openai(url, pki, "sk-wrong").models.list()
    reply = _openai(url, pki, API_KEY).chat.completions.create(
        model=model, messages=messages, max_tokens=4)  # frontend -> router -> worker over mTLS
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    health = urllib.request.urlopen(url + "/health", timeout=10,
                                    context=_https(pki, pki.client))
    assert health.status == 200  # probes need no key


@pytest.mark.parametrize("cert", ["none", "rogue"])
def test_mtls_https_port_refuses_clients_without_a_trusted_certificate(
        pki: Pki, secure_topology: Topology, cert: str) -> None:
    """--tls-require-client-cert holds on the frontend's HTTPS port too: no certificate, or one
    from another CA, is refused in the handshake, before any API key is looked at."""
    context = _https(pki, None if cert == "none" else pki.rogue)
    request = urllib.request.Request(secure_topology.http_url + "/v1/models",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)) as info:
        urllib.request.urlopen(request, timeout=10, context=context).read()
    assert "certificate" in str(info.value).lower() or isinstance(
        info.value, (ConnectionError, ssl.SSLError)), info.value
    reply = urllib.request.urlopen(request, timeout=10, context=_https(pki, pki.client))
    assert reply.status == 200


def test_grpc_inference_api_needs_the_api_key(pki: Pki, secure_topology: Topology) -> None:
    address, model = secure_topology.grpc_address, secure_topology.model
    with _secure(address, pki, pki.client) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        auth = (("authorization", f"Bearer {API_KEY}"),)
        reply = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10, metadata=auth)
        assert [m.id for m in reply.models] == [model]
        chunks = list(stub.Generate(inference_pb2.InferenceRequest(
            model=model, prompt="Hello", sampling=common_pb2.SamplingParams(max_tokens=3)),
            timeout=30, metadata=auth))
        assert sum(len(c.token_ids) for c in chunks) == 3
    _refused(_secure(address, pki, pki.rogue))


def test_tandem_status_speaks_mtls_from_flags_or_the_environment(
        pki: Pki, secure_topology: Topology) -> None:
    """`tandem status` reaches the router's mTLS port with the services' TLS flags or TANDEM_TLS_*
    variables, an API key from TANDEM_API_KEY riding along (the router checks none)."""
    def status(*flags: str, environ: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(tandem_cmd("status", "--router-address",
                                         secure_topology.router_address, "--json", *flags),
                              cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, **(environ or {})})

    for reply in (status(environ=_tls_environ(pki) | {"TANDEM_API_KEY": API_KEY}),
                  status("--tls-ca-file", str(pki.ca), "--tls-cert-file", str(pki.client[0]),
                         "--tls-key-file", str(pki.client[1]), "--api-key", API_KEY)):
        assert reply.returncode == 0, reply.stderr
        (pool,) = json.loads(reply.stdout)["pools"]
        assert [(w["worker_id"], w["candidate"]) for w in pool["workers"]] == [
            (secure_topology.decode_addresses[0], True)]
    # Plaintext, or TLS without a client certificate: refused, in one line (the JSON says only
    # what the local launcher knows, and the error).
    for refused in (status(), status("--tls-ca-file", str(pki.ca))):
        assert refused.returncode == 1 and "pools" not in json.loads(refused.stdout)
        assert json.loads(refused.stdout)["error"] in refused.stderr
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
