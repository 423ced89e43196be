"""deploy/compose/tls.yaml, the Compose override that turns TLS on: valid Compose, every Tandem
service of compose.yaml covered, each service's command with the override's environment parsed
by this version's CLI into the intended TLS config, secrets mounted where the variables point,
the health check reading the same variables; and deploy/compose/make-certs.sh makes a certificate
that fits (verified by openssl, with the names the services and clients use)."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml
from cli_capture import parse_serve
from test_compose import ROOT, SCHEMA, interpolate, load_compose, tandem_services, with_host_paths

from tandem.runtime import config as config_lib
from tandem.runtime.tls import TlsConfig

OVERRIDE = ROOT / "deploy" / "compose" / "tls.yaml"
HEALTH_SCRIPT = ROOT / "deploy" / "docker" / "grpc_health_check.py"
MAKE_CERTS = ROOT / "deploy" / "compose" / "make-certs.sh"


def load_override(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(OVERRIDE.read_text()), env or {})


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """One service as `docker compose -f compose.yaml -f tls.yaml` merges it: mappings merge key
    by key, `secrets` (a sequence) is appended to; every other field here is a mapping."""
    out = dict(base)
    for key, value in override.items():
        if key == "secrets":
            out[key] = [*base.get(key, []), *value]
        elif isinstance(value, dict):
            out[key] = {**base.get(key, {}), **value}
        else:
            out[key] = value
    return out


def test_override_is_valid_compose() -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(load_override())]
    assert errors == []


def test_every_service_gets_tls_from_its_environment() -> None:
    compose, override = load_compose(), load_override()
    services = tandem_services(compose)
    assert set(override["services"]) == set(services)
    secrets = override["secrets"]
    for name, base in services.items():
        service = merged(base, override["services"][name])
        env = {k: str(v) for k, v in service["environment"].items()}
        assert env["OTEL_SERVICE_NAME"] == base["environment"]["OTEL_SERVICE_NAME"]  # kept
        stage, config = parse_serve(with_host_paths(name, service), env)
        tls: TlsConfig = config.tls
        # Every file the config names is a secret of the service, mounted at /run/secrets/NAME
        # (Compose's short syntax), from the directory make-certs.sh writes to.
        mounted = {f"/run/secrets/{s}": secrets[s]["file"] for s in service["secrets"]}
        files = {tls.cert_file: "server.pem", tls.key_file: "server.key", tls.ca_file: "ca.pem"}
        for path, file_name in files.items():
            assert PurePosixPath(mounted[path]) == PurePosixPath("deploy/compose/certs",
                                                                 file_name), (name, path)
        assert tls.server_name == "tandem"
        # mTLS on every internal port; the public gRPC port takes clients without certificates.
        assert tls.require_client_cert is (stage != "frontend"), name


def test_variables_follow_the_flags_and_the_health_check_reads_them() -> None:
    names = {f.name: config_lib.env_var(f) for f in dataclasses.fields(TlsConfig)}
    env = load_override()["x-tls-env"]
    assert set(env) == set(names.values())
    script = HEALTH_SCRIPT.read_text()
    for field in ("cert_file", "key_file", "ca_file", "server_name"):
        assert f'"{names[field]}"' in script, field
    assert load_override({"TLS_SERVER_NAME": "tandem.internal"})["x-tls-env"][
        "TANDEM_TLS_SERVER_NAME"] == "tandem.internal"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_make_certs_writes_what_the_override_mounts(tmp_path: Path) -> None:
    subprocess.run(["bash", str(MAKE_CERTS), str(tmp_path)], check=True, capture_output=True)
    wanted = {Path(s["file"]).name for s in load_override()["secrets"].values()}
    assert wanted <= {p.name for p in tmp_path.iterdir()}

    def openssl(*args: str) -> str:
        return subprocess.run(["openssl", *args], check=True, capture_output=True,
                              text=True).stdout

    assert "OK" in openssl("verify", "-CAfile", str(tmp_path / "ca.pem"),
                           str(tmp_path / "server.pem"))
    ext = openssl("x509", "-in", str(tmp_path / "server.pem"), "-noout", "-ext",
                  "subjectAltName,extendedKeyUsage")
    for name in ("DNS:tandem", "DNS:localhost", "IP Address:127.0.0.1",
                 "TLS Web Server Authentication", "TLS Web Client Authentication"):
        assert name in ext
    # The key belongs to the certificate.
    assert openssl("x509", "-in", str(tmp_path / "server.pem"), "-noout", "-pubkey") == \
        openssl("pkey", "-in", str(tmp_path / "server.key"), "-pubout")
