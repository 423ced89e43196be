"""deploy/k8s/tls, the kustomize Component that turns TLS on: its JSON patches applied to the
base Deployments (as kustomize applies them) give every container the TANDEM_TLS_* variables
that this version's CLI turns into the intended TLS config, from files of the mounted Secret
named as deploy/compose/make-certs.sh writes them; every gRPC probe becomes an exec probe of
grpc-health-check on the same port and service; nothing else changes."""
from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import yaml
from cli_capture import parse_serve
from test_k8s_manifests import K8S, ROOT, argv_of, container, of_kind

from tandem.runtime.tls import TlsConfig

COMPONENT = K8S / "tls" / "kustomization.yaml"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
#: Files of the Secret, by the names make-certs.sh gives them.
CERT_FILES = {"cert_file": "server.pem", "key_file": "server.key", "ca_file": "ca.pem"}


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add, remove and replace (what the Component uses), in place."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        elif isinstance(node, list):
            if last == "-":
                node.append(op["value"])
            else:
                node.insert(int(last), op["value"])
        else:
            assert op["op"] in ("add", "replace"), op
            assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
            node[last] = op["value"]


def targets(target: dict[str, str], doc: dict[str, Any]) -> bool:
    labels = doc["metadata"].get("labels", {})
    selector = dict(s.split("=", 1) for s in target.get("labelSelector", "").split(",") if s)
    return (doc["kind"] == target.get("kind", doc["kind"])
            and doc["metadata"]["name"] == target.get("name", doc["metadata"]["name"])
            and all(labels.get(k) == v for k, v in selector.items()))


def patched() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name -> (base Deployment, the Deployment with the Component's patches applied)."""
    component = yaml.safe_load(COMPONENT.read_text())
    assert component["kind"] == "Component"
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    out = {}
    for name, base in of_kind("Deployment").items():
        doc = copy.deepcopy(base)
        for patch in component["patches"]:
            if targets(patch["target"], doc):
                apply_json_patch(doc, yaml.safe_load(patch["patch"]))
        out[name] = (base, doc)
    return out


def test_every_deployment_gets_tls_from_the_secret(tmp_path: pathlib.Path) -> None:
    for name, (_, doc) in patched().items():
        c = container(doc)
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        stage, config = parse_serve(argv_of(doc, tmp_path), env)
        tls: TlsConfig = config.tls
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
        assert volumes["tls"]["secret"]["secretName"] == "tandem-tls"
        for field, file_name in CERT_FILES.items():
            assert getattr(tls, field) == f"{mount['mountPath']}/{file_name}", (name, field)
        assert tls.server_name == "tandem"
        # mTLS on every internal port; the public ports take clients without certificates.
        assert tls.require_client_cert is (stage != "frontend"), name


def test_grpc_probes_become_exec_probes_of_the_same_check() -> None:
    for name, (base, doc) in patched().items():
        before, after = container(base), container(doc)
        assert any("grpc" in before.get(p, {}) for p in PROBES), name
        for probe in PROBES:
            if probe not in before:
                assert probe not in after
                continue
            old, new = before[probe], after[probe]
            if "grpc" not in old:  # the router's TCP liveness check works through TLS
                assert new == old
                continue
            grpc_check = old["grpc"]
            assert new["exec"]["command"] == [
                "grpc-health-check", f"127.0.0.1:{grpc_check['port']}", "--service",
                grpc_check.get("service", "")], (name, probe)
            assert {k: v for k, v in new.items() if k != "exec"} == \
                {k: v for k, v in old.items() if k != "grpc"}, (name, probe)


def test_nothing_else_changes() -> None:
    def without_tls(doc: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(doc)
        spec = doc["spec"]["template"]["spec"]
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "tls"]
        c = spec["containers"][0]
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "tls"]
        c["env"] = [e for e in c["env"] if not e["name"].startswith("TANDEM_TLS_")]
        for probe in PROBES:
            c.pop(probe, None)
        return doc

    for name, (base, doc) in patched().items():
        assert without_tls(doc) == without_tls(base), name


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.trtllm"])
def test_images_install_the_health_check_the_probes_run(dockerfile: str) -> None:
    text = (ROOT / "deploy" / "docker" / dockerfile).read_text()
    assert "deploy/docker/grpc_health_check.py /usr/local/bin/grpc-health-check" in text


def test_secret_file_names_match_the_compose_override() -> None:
    override = yaml.safe_load((ROOT / "deploy" / "compose" / "tls.yaml").read_text())
    compose_files = {pathlib.PurePosixPath(s["file"]).name for s in override["secrets"].values()}
    assert compose_files == set(CERT_FILES.values())
