"""The Kubernetes connector: the planner sizes each pool by the replica count of its Deployment.

It speaks to the API server with the official client's asyncio API (`kubernetes.aio`, the
optional extra `tandem[k8s]`) and touches two things only:

- the **scale subresource** of each pool's Deployment
  (`GET`/`PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`, the PATCH a JSON merge
  patch `{"spec": {"replicas": N}}`): the Deployment's spec is never rewritten, so a
  `kubectl apply` of the manifests and the planner change different fields. The scale also
  carries the Deployment's pod selector (`status.selector`), so the Deployment itself is never
  read either;
- when a pool shrinks, the **pods**: `scale(remove=...)` names workers as the router knows
  them (`host:port`, host being the pod IP: deploy/k8s sets `--worker-id $(POD_IP):PORT`),
  and the connector lists the pool's pods and sets the annotation
  `controller.kubernetes.io/pod-deletion-cost` on those (merge patches), before the scale
  PATCH. A shrinking ReplicaSet deletes, among its running and ready pods, those of lowest
  cost first (the annotation is beta and on by default since Kubernetes 1.22); pods not yet
  ready go before any of them, which costs nothing (they hold no request).

Nothing here drains: a deleted pod leaves its Service's endpoints (the router's DNS pool drops
it within `dns_refresh_s`), its preStop hook waits for that, and SIGTERM makes the worker drain
(health NOT_SERVING, in-flight requests finish within `--grace-period-s`, the frontend migrates
what does not), all within `terminationGracePeriodSeconds` (deploy/k8s/decode.yaml).

The annotation is best effort in one respect: the ReplicaSet controller reads pods from its own
cache, which may see the scale change before the annotations (both are watch events, from two
informers). Then another pod goes first; it drains as well, so no request is lost, only the
cached prefixes the choice was meant to keep. The planner owns the annotation on its pools'
pods: each scale-down sets it on the pods it names and clears it from every other pod, so that
an old choice never decides a later scale-down.

The planner's ServiceAccount needs exactly: get and patch on `deployments/scale`, list and patch
on `pods` (deploy/k8s/planner-rbac.yaml). Read-only (`read_only`, for an HPA or KEDA that
applies the planner's exported desired counts instead), it needs get on `deployments/scale`
only.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from tandem.errors import InvalidRequest, UpstreamError
from tandem.planner.connector import Connector
from tandem.planner.service_config import PlannerServiceConfig

try:
    from kubernetes.aio import client as k8s
    from kubernetes.aio import config as k8s_config
    from kubernetes.aio.client.models import V1Pod
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError("the Kubernetes connector needs the official Kubernetes client: "
                      "pip install 'tandem[k8s]'") from exc

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The annotation a shrinking ReplicaSet ranks its pods by (lowest first); an int32 as a string.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
#: RFC 7386: the body is the part of the object to change, a null deleting a key.
MERGE_PATCH = "application/merge-patch+json"
#: Where a pod finds its own namespace (every pod with a ServiceAccount token has it).
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class KubernetesConnector(Connector):
    """Reads and sets the replica counts of one Deployment per pool (see the module docstring).

    Args:
        api: an ApiClient of `kubernetes.aio`, configured for the cluster (`connect` makes one);
            the connector owns it and closes it in `close`.
        namespace: where the Deployments are.
        deployments: pool name -> Deployment name. Tandem's manifests name each worker
            Deployment after its pool (`{p.name: p.name for p in planner_config.pools}`).
        read_only: read the counts, never set them: an HPA or KEDA applies the planner's
            desired counts from its metrics instead (deploy/README.md); `scale` only logs.
    Raises:
        InvalidRequest: no pool, or an empty pool or Deployment name.
    """

    def __init__(self, api: k8s.ApiClient, namespace: str, deployments: Mapping[str, str],
                 read_only: bool = False) -> None:
        if not deployments:
            raise InvalidRequest("the Kubernetes connector needs at least one pool's Deployment")
        for pool, name in deployments.items():
            if not pool or not name:
                raise InvalidRequest(f"pool {pool!r}: an empty pool or Deployment name "
                                     f"({name!r})", param="deployments")
        if not namespace:
            raise InvalidRequest("the Kubernetes connector needs a namespace", param="namespace")
        self.namespace = namespace
        self.deployments = dict(deployments)
        self.read_only = read_only
        self._api = api
        self._apps = k8s.AppsV1Api(api)
        self._core = k8s.CoreV1Api(api)

    @classmethod
    async def connect(cls, deployments: Mapping[str, str], namespace: str = "",
                      kubeconfig: str = "", read_only: bool = False) -> KubernetesConnector:
        """A connector for the cluster this process runs in (its pod's ServiceAccount), or,
        outside a cluster or with `kubeconfig`, for the current context of that kubeconfig
        (default ~/.kube/config). `namespace` unset: the pod's own namespace, else the
        context's, else `default`. Raises the client's ConfigException when neither works."""
        configuration = k8s.Configuration()
        if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)
            if not namespace:
                with open(NAMESPACE_FILE, encoding="utf-8") as f:
                    namespace = f.read().strip()
        else:
            await k8s_config.load_kube_config(config_file=kubeconfig or None,
                                              client_configuration=configuration)
            if not namespace:
                _, context = k8s_config.list_kube_config_contexts(kubeconfig or None)
                namespace = context.get("context", {}).get("namespace", "") or "default"
        return cls(k8s.ApiClient(configuration), namespace, deployments, read_only)

    async def actual(self) -> dict[str, int]:
        """Each pool's Deployment's spec.replicas: the pods it keeps, those starting included;
        a pod being deleted (draining) has already left the count."""
        scales = await asyncio.gather(*(self._read_scale(name)
                                        for name in self.deployments.values()))
        return {pool: _replicas(scale) for pool, scale in zip(self.deployments, scales)}

    async def scale(self, pool: str, target: int, remove: Sequence[str] = ()) -> None:
        """Sets the pool's Deployment to `target` replicas; shrinking, it first ranks the
        workers named in `remove` for deletion, in order (see the module docstring). Raises
        KeyError for an unknown pool, InvalidRequest for a negative target, UpstreamError when
        the API server refuses or cannot be reached."""
        name = self._deployment(pool)
        if target < 0:
            raise InvalidRequest(f"pool {pool}: a negative worker count ({target})")
        if self.read_only:
            log.info("desired workers left to the autoscaler", extra={
                "pool": pool, "deployment": name, "target": target})
            return
        scale = await self._read_scale(name)
        current = _replicas(scale)
        if target == current:
            return
        if target < current:
            selector = scale.status.selector if scale.status else ""
            await self._rank_for_deletion(name, selector or "", remove)
        body = {"spec": {"replicas": target}}
        await self._call(f"PATCH deployments/{name}/scale",
                         self._apps.patch_namespaced_deployment_scale(
                             name, self.namespace, body, _content_type=MERGE_PATCH))
        log.info("scaled deployment", extra={"pool": pool, "deployment": name,
                                             "namespace": self.namespace, "from": current,
                                             "to": target, "remove_first": list(remove)})

    async def close(self) -> None:
        await self._api.close()

    def _deployment(self, pool: str) -> str:
        try:
            return self.deployments[pool]
        except KeyError:
            raise KeyError(f"no Deployment is mapped to pool {pool!r} (known: "
                           f"{', '.join(self.deployments)})") from None

    async def _read_scale(self, name: str) -> Any:
        return await self._call(f"GET deployments/{name}/scale",
                                self._apps.read_namespaced_deployment_scale(name, self.namespace))

    async def _rank_for_deletion(self, name: str, selector: str, remove: Sequence[str]) -> None:
        """Sets the deletion cost of the pods `remove` names (the first lowest, all below the
        default 0) and clears it from the pool's other pods."""
        if not selector:  # a Deployment always has one; without it every pod would be listed
            log.warning("the deployment's scale has no selector: Kubernetes picks the pods to "
                        "remove", extra={"deployment": name})
            return
        pods = await self._call(f"LIST pods of deployment {name}",
                                self._core.list_namespaced_pod(self.namespace,
                                                               label_selector=selector))
        live = [pod for item in pods.items if (pod := _PodView.of(item)) is not None]
        by_host = {host: pod.name for pod in live for host in pod.hosts}
        costs: dict[str, str | None] = {}
        for rank, worker in enumerate(remove):
            found = by_host.get(_host(worker))
            if found is None:
                log.warning("a worker to remove is none of the deployment's pods; not ranked",
                            extra={"worker": worker, "deployment": name})
                continue
            costs.setdefault(found, str(rank - len(remove)))
        await asyncio.gather(*(self._set_cost(pod.name, costs.get(pod.name))
                               for pod in live if pod.cost != costs.get(pod.name)))

    async def _set_cost(self, pod: str, cost: str | None) -> None:
        """Sets (None: removes) the pod's deletion cost annotation."""
        body = {"metadata": {"annotations": {DELETION_COST: cost}}}
        await self._call(f"PATCH pods/{pod}", self._core.patch_namespaced_pod(
            pod, self.namespace, body, _content_type=MERGE_PATCH))

    async def _call(self, what: str, call: Awaitable[T]) -> T:
        """Awaits one API call; its failure becomes an UpstreamError that says what and why."""
        try:
            return await call
        except k8s.ApiException as exc:
            hint = (" (the planner's Role must grant it: deploy/k8s/planner-rbac.yaml)"
                    if exc.status == 403 else "")
            raise UpstreamError(f"Kubernetes API: {what} in namespace {self.namespace}: "
                                f"{exc.status} {exc.reason}{hint}") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"Kubernetes API: {what}: {type(exc).__name__}: {exc}") from exc


async def create_connector(config: PlannerServiceConfig) -> KubernetesConnector:
    """`tandem serve planner --connector kubernetes`: each pool of the plan is the Deployment
    of the same name (as in deploy/k8s), in the planner pod's own namespace (outside a
    cluster: the current context of the kubeconfig, $KUBECONFIG or ~/.kube/config)."""
    return await KubernetesConnector.connect({pool.name: pool.name for pool in config.plan.pools})


async def create_read_only_connector(config: PlannerServiceConfig) -> KubernetesConnector:
    """As create_connector, but it never sets a count: an HPA or KEDA on the planner's
    desired-workers metric does (its Role then needs only get on deployments/scale)."""
    return await KubernetesConnector.connect({pool.name: pool.name for pool in config.plan.pools},
                                             read_only=True)


def _replicas(scale: Any) -> int:
    """A Scale's spec.replicas (absent: 0, as the API server reads it)."""
    return (scale.spec.replicas or 0) if scale.spec else 0


def _host(worker: str) -> str:
    """The host of a `host:port` worker id (IPv6 in brackets or not)."""
    host, sep, port = worker.rpartition(":")
    if not sep or not port.isdigit():
        return worker
    return host.removeprefix("[").removesuffix("]")


@dataclass(frozen=True)
class _PodView:
    """What the connector reads of a pod."""

    name: str
    #: What a worker id may name the pod by: its IPs, and its name (--worker-id set to it).
    hosts: tuple[str, ...]
    #: Its deletion cost annotation (None: none).
    cost: str | None

    @classmethod
    def of(cls, pod: V1Pod) -> _PodView | None:
        """The view of a pod that is not being deleted (None for one that is: it drains
        already and is out of the Deployment's count)."""
        meta = pod.metadata
        if meta is None or not meta.name or meta.deletion_timestamp is not None:
            return None
        status = pod.status
        ips = [status.pod_ip] if status and status.pod_ip else []
        ips += [ip.ip for ip in (status.pod_ips or ())] if status else []
        return cls(meta.name, (*ips, meta.name), (meta.annotations or {}).get(DELETION_COST))
