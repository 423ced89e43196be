"""tandem.planner.k8s against a fake API server (tests/unit/kube_api_fake.py): the official
client's requests are the ones the Kubernetes API documents for the scale subresource and for
pods (method, path, query, Content-Type of each PATCH, body), a scale-down ranks the named pods
for deletion before it shrinks, and the planner's Role grants every request and nothing more.
No cluster runs here: what a real API server and ReplicaSet controller then do is not tested."""
from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
import yaml
from kube_api_fake import MERGE_PATCH, FakeKubeApi, Recorded, selector_string
from kubernetes.aio import client as k8s

from tandem.errors import InvalidRequest, UpstreamError
from tandem.planner.config import planner_config_from_dict
from tandem.planner.k8s import (
    DELETION_COST,
    KubernetesConnector,
    create_connector,
    create_read_only_connector,
)
from tandem.planner.service_config import PlannerServiceConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS = "tandem"
SCALE = "/apis/apps/v1/namespaces/tandem/deployments/{}/scale"
PODS = "/api/v1/namespaces/tandem/pods"
DECODE = {"app.kubernetes.io/name": "decode", "app.kubernetes.io/part-of": "tandem"}
PREFILL = {"app.kubernetes.io/name": "prefill", "app.kubernetes.io/part-of": "tandem"}
TOKEN = "planner-token"


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    fake = FakeKubeApi(NS, {"prefill": (2, PREFILL), "decode": (3, DECODE)})
    for i, name in enumerate(("decode-a", "decode-b", "decode-c")):
        fake.add_pod(name, DECODE, f"10.0.0.{i + 1}")
    fake.add_pod("prefill-a", PREFILL, "10.0.1.1")
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def connector(api: FakeKubeApi) -> AsyncIterator[KubernetesConnector]:
    configuration = k8s.Configuration(host=api.url)
    configuration.api_key = {"BearerToken": f"Bearer {TOKEN}"}
    conn = KubernetesConnector(k8s.ApiClient(configuration), NS,
                               {"prefill": "prefill", "decode": "decode"})
    yield conn
    await conn.close()


def calls(api: FakeKubeApi) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in api.requests]


async def test_actual_reads_each_pools_scale(api: FakeKubeApi,
                                            connector: KubernetesConnector) -> None:
    assert await connector.actual() == {"prefill": 2, "decode": 3}
    assert sorted(calls(api)) == [("GET", SCALE.format("decode")), ("GET", SCALE.format("prefill"))]
    assert all(r.body is None and r.authorization == f"Bearer {TOKEN}" for r in api.requests)


async def test_scale_up_merge_patches_the_scale_only(api: FakeKubeApi,
                                                     connector: KubernetesConnector) -> None:
    await connector.scale("decode", 5)
    assert calls(api) == [("GET", SCALE.format("decode")), ("PATCH", SCALE.format("decode"))]
    patch = api.requests[1]
    assert patch.content_type == MERGE_PATCH
    assert patch.body == {"spec": {"replicas": 5}}
    assert api.deployments["decode"][0] == 5
    assert await connector.actual() == {"prefill": 2, "decode": 5}


async def test_the_same_target_changes_nothing(api: FakeKubeApi,
                                               connector: KubernetesConnector) -> None:
    await connector.scale("decode", 3, remove=["10.0.0.1:9200"])
    assert calls(api) == [("GET", SCALE.format("decode"))]
    assert api.annotations("decode-a") == {}


async def test_scale_down_ranks_the_named_pods_before_it_shrinks(
        api: FakeKubeApi, connector: KubernetesConnector) -> None:
    # decode-a carries a cost from an earlier choice; decode-d is being deleted (draining).
    api.pods["decode-a"]["metadata"]["annotations"] = {DELETION_COST: "-5", "keep": "me"}
    api.add_pod("decode-d", DECODE, "10.0.0.4", {DELETION_COST: "-9"}, deleting=True)
    await connector.scale("decode", 1, remove=["10.0.0.2:9200", "10.0.0.3:9200",
                                               "10.9.9.9:9200"])
    get_scale, list_pods, *patches, patch_scale = api.requests
    assert (get_scale.method, get_scale.path) == ("GET", SCALE.format("decode"))
    # The pool's pods, found by the selector the Scale carries.
    assert (list_pods.method, list_pods.path) == ("GET", PODS)
    assert list_pods.query == {"labelSelector": selector_string(DECODE)}
    # Every pod patch is a merge patch of the annotation alone, and comes before the shrink.
    assert sorted(r.path for r in patches) == [f"{PODS}/decode-{x}" for x in "abc"]
    for r in patches:
        assert r.method == "PATCH" and r.content_type == MERGE_PATCH
        assert set(r.body) == {"metadata"} and set(r.body["metadata"]) == {"annotations"}
    assert (patch_scale.method, patch_scale.path) == ("PATCH", SCALE.format("decode"))
    assert patch_scale.body == {"spec": {"replicas": 1}}
    # First named, lowest cost; both below the default 0; the stale cost is gone (null in a
    # merge patch deletes the key), the pod's other annotations stay.
    assert api.annotations("decode-b") == {DELETION_COST: "-3"}
    assert api.annotations("decode-c") == {DELETION_COST: "-2"}
    assert api.annotations("decode-a") == {"keep": "me"}
    assert api.annotations("decode-d") == {DELETION_COST: "-9"}  # not touched
    assert api.annotations("prefill-a") == {}


async def test_a_second_scale_down_patches_only_what_changed(
        api: FakeKubeApi, connector: KubernetesConnector) -> None:
    await connector.scale("decode", 2, remove=["10.0.0.3:9200"])
    api.requests.clear()
    api.deployments["decode"] = (3, DECODE)  # the ReplicaSet has not removed it yet
    await connector.scale("decode", 2, remove=["10.0.0.3:9200"])
    assert [r.method for r in api.requests] == ["GET", "GET", "PATCH"]  # the scale only
    await connector.scale("decode", 1)  # no choice now: the old one is withdrawn
    assert api.annotations("decode-c") == {}


async def test_read_only_reads_the_counts_and_never_sets_them(api: FakeKubeApi) -> None:
    conn = KubernetesConnector(k8s.ApiClient(k8s.Configuration(host=api.url)), NS,
                               {"decode": "decode"}, read_only=True)
    try:
        assert await conn.actual() == {"decode": 3}
        await conn.scale("decode", 1, remove=["10.0.0.1:9200"])
        await conn.scale("decode", 6)
    finally:
        await conn.close()
    assert calls(api) == [("GET", SCALE.format("decode"))]


async def test_the_services_factories_map_each_pool_to_its_deployment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[dict[str, str], bool]] = []

    async def connect(deployments: dict[str, str], read_only: bool = False) -> str:
        made.append((deployments, read_only))
        return "connector"

    monkeypatch.setattr(KubernetesConnector, "connect", connect)
    plan = planner_config_from_dict({"pools": [
        {"name": "prefill", "role": "prefill", "ttft_target_ms": 300},
        {"name": "decode", "role": "decode", "itl_target_ms": 25}]})
    config = PlannerServiceConfig(connector="kubernetes", plan=plan)
    assert await create_connector(config) == await create_read_only_connector(config)
    assert made == [({"prefill": "prefill", "decode": "decode"}, False),
                    ({"prefill": "prefill", "decode": "decode"}, True)]


async def test_a_refusal_says_what_and_points_at_the_role(
        api: FakeKubeApi, connector: KubernetesConnector) -> None:
    api.forbid.add(("PATCH", SCALE.format("decode")))
    with pytest.raises(UpstreamError, match=r"PATCH deployments/decode/scale .*403 .*"
                                            r"planner-rbac\.yaml"):
        await connector.scale("decode", 4)
    with pytest.raises(KeyError, match="encode"):
        await connector.scale("encode", 1)
    with pytest.raises(InvalidRequest):
        await connector.scale("decode", -1)


async def test_an_unreachable_server_is_an_upstream_error(api: FakeKubeApi,
                                                          connector: KubernetesConnector) -> None:
    await api.stop()
    with pytest.raises(UpstreamError, match="GET deployments/.*/scale"):
        await connector.actual()


async def test_connect_reads_a_kubeconfig(api: FakeKubeApi, tmp_path: pathlib.Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "planner", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "planner",
                                                  "namespace": NS}}]}))
    conn = await KubernetesConnector.connect({"decode": "decode"}, kubeconfig=str(kubeconfig))
    try:
        assert conn.namespace == NS
        assert await conn.actual() == {"decode": 3}
    finally:
        await conn.close()
    assert api.requests[0].authorization == f"Bearer {TOKEN}"


# ---- the Role grants what the connector does --------------------------------------------------

def _attributes(r: Recorded) -> tuple[str, str, str, str]:
    """(API group, resource[/subresource], verb, name) of a request, as RBAC authorizes it."""
    parts = r.path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    assert rest[0] == "namespaces" and rest[1] == NS, r.path
    resource, name, sub = rest[2], (rest[3:4] or [""])[0], rest[4:]
    verb = {"GET": "get" if name else "list", "PATCH": "patch"}[r.method]
    return group, "/".join([resource, *sub]), verb, name


def _role_rules() -> list[dict[str, list[str]]]:
    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/planner-rbac.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "Role"]
    return role["rules"]


def _allowed(rule: dict[str, list[str]], attrs: tuple[str, str, str, str]) -> bool:
    group, resource, verb, name = attrs
    return (group in rule["apiGroups"] and resource in rule["resources"]
            and verb in rule["verbs"]
            and (not rule.get("resourceNames") or name in rule["resourceNames"]))


async def test_the_role_grants_every_request_and_no_more(
        api: FakeKubeApi, connector: KubernetesConnector) -> None:
    api.pods["decode-a"]["metadata"]["annotations"] = {DELETION_COST: "-1"}
    await connector.actual()
    await connector.scale("prefill", 3)
    await connector.scale("decode", 1, remove=["10.0.0.2:9200"])
    used = {_attributes(r) for r in api.requests}
    rules = _role_rules()
    for attrs in used:
        assert any(_allowed(rule, attrs) for rule in rules), f"the Role does not grant {attrs}"
    granted = {(g, res, verb) for rule in rules for g in rule["apiGroups"]
               for res in rule["resources"] for verb in rule["verbs"]}
    assert granted == {(g, res, verb) for g, res, verb, _ in used}
