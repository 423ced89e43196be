"""A fake Kubernetes API server for the connector's tests: the few endpoints the planner uses, as
the API reference documents them, on a loopback port, recording every request.

- `GET /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`: an autoscaling/v1 Scale
  (spec.replicas, status.replicas, status.selector as the query-param string);
- `PATCH` of the same: the body applied as the Content-Type says; only JSON merge patches
  (RFC 7386) are applied, the other patch types the API accepts (json-patch, strategic merge,
  apply) are answered 415 here so that a test sees which one the client sent;
- `GET /api/v1/namespaces/{ns}/pods?labelSelector=...`: a PodList of the pods whose labels
  match (equality selectors: `k=v,k2=v2`);
- `PATCH /api/v1/namespaces/{ns}/pods/{name}`: a merge patch of the pod.

Anything else is a 404 Status, as the API server answers an unknown path; `forbid` makes a
(method, path) answer 403 Forbidden, as without RBAC permission.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MERGE_PATCH = "application/merge-patch+json"
PATCH_TYPES = {"application/json-patch+json", MERGE_PATCH,
               "application/strategic-merge-patch+json", "application/apply-patch+yaml"}


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    #: Parsed JSON body (None: none).
    body: Any
    authorization: str


@dataclass
class FakeKubeApi:
    namespace: str = "tandem"
    #: Deployment name -> (replicas, selector labels).
    deployments: dict[str, tuple[int, dict[str, str]]] = field(default_factory=dict)
    #: Pod name -> the pod as JSON (metadata.labels, metadata.annotations, status.podIP ...).
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    #: (method, path) pairs answered 403.
    forbid: set[tuple[str, str]] = field(default_factory=set)
    url: str = ""
    _runner: web.AppRunner | None = None

    def add_pod(self, name: str, labels: dict[str, str], ip: str,
                annotations: dict[str, str] | None = None, deleting: bool = False) -> None:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": labels,
                                "uid": f"uid-{name}"}
        if annotations:
            meta["annotations"] = dict(annotations)
        if deleting:
            meta["deletionTimestamp"] = "2026-12-01T10:00:00Z"
        self.pods[name] = {
            "apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "worker", "image": "tandem-trtllm:1.2.1"}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}

    def annotations(self, pod: str) -> dict[str, str]:
        return dict(self.pods[pod]["metadata"].get("annotations") or {})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.requests.append(Recorded(request.method, request.path, dict(request.query),
                                      request.headers.get("Content-Type", ""), body,
                                      request.headers.get("Authorization", "")))
        if (request.method, request.path) in self.forbid:
            return _status(403, "Forbidden", f"{request.method} {request.path} is forbidden")
        parts = request.path.strip("/").split("/")
        if parts[:3] == ["apis", "apps", "v1"] and len(parts) == 8 and parts[-1] == "scale" \
                and parts[3:6:2] == ["namespaces", "deployments"]:
            return self._scale(request, parts[4], parts[6], body)
        if parts[:2] == ["api", "v1"] and parts[2:3] == ["namespaces"] and parts[4:5] == ["pods"]:
            if len(parts) == 5 and request.method == "GET":
                return self._list_pods(parts[3], request.query.get("labelSelector", ""))
            if len(parts) == 6 and request.method == "PATCH":
                return self._patch_pod(request, parts[3], parts[5], body)
        return _status(404, "NotFound", f"the server could not find {request.path}")

    def _scale(self, request: web.Request, ns: str, name: str, body: Any) -> web.Response:
        if ns != self.namespace or name not in self.deployments:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        replicas, labels = self.deployments[name]
        if request.method == "PATCH":
            if (error := _patch_error(request)) is not None:
                return error
            scale = merge_patch({"spec": {"replicas": replicas}}, body)
            replicas = scale["spec"]["replicas"]
            self.deployments[name] = (replicas, labels)
        elif request.method != "GET":
            return _status(405, "MethodNotAllowed", request.method)
        return web.json_response({
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
            "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "selector": selector_string(labels)}})

    def _list_pods(self, ns: str, selector: str) -> web.Response:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        items = [p for p in self.pods.values() if p["metadata"]["namespace"] == ns
                 and all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": "1"}, "items": items})

    def _patch_pod(self, request: web.Request, ns: str, name: str, body: Any) -> web.Response:
        if ns != self.namespace or name not in self.pods:
            return _status(404, "NotFound", f'pods "{name}" not found')
        if (error := _patch_error(request)) is not None:
            return error
        self.pods[name] = merge_patch(self.pods[name], body)
        return web.json_response(self.pods[name])


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, null deletes, anything else
    replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def selector_string(labels: dict[str, str]) -> str:
    """A label selector as the Scale's status.selector carries it."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _patch_error(request: web.Request) -> web.Response | None:
    content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
    if content_type not in PATCH_TYPES:
        return _status(415, "UnsupportedMediaType",
                       f"the body of the request was in an unknown format: {content_type}")
    if content_type != MERGE_PATCH:
        return _status(415, "UnsupportedMediaType", f"this fake applies merge patches only, "
                       f"got {content_type}")
    return None


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {},
                              "status": "Failure", "message": message, "reason": reason,
                              "code": code}, status=code)
