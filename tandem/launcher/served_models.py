"""What a deployment serves, model by model: the pools of workers the launcher starts and the
routers that pick among them. A deployment serves one model (its flat fields) or several
(`models`), each with pools and a router of its own."""
from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field

from tandem.engines.args import EngineArgs
from tandem.errors import InvalidRequest
from tandem.launcher.deployment import Deployment, DeploymentPool
from tandem.launcher.placement import PoolFields


@dataclass(frozen=True)
class ModelTopology:
    """What `processes` starts for one served model: its workers' pools and its routers."""

    #: Served name; "": the model directory's name (single-model deployments).
    name: str
    engine_args: EngineArgs
    pools: list[DeploymentPool]
    #: Router process name -> port.
    routers: dict[str, int]
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    worker_flags: list[str] = field(default_factory=list)
    #: The config keys of each pool's placement, in the order of `pools` (for errors).
    pool_fields: list[PoolFields] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """What the frontend serves for this model: embedding when its only pools are
        embedding pools, else text."""
        kinds = {p.kind for p in self.pools if p.kind != "video"}
        return "embedding" if kinds == {"embedding"} else "text"


def pools(d: Deployment) -> list[tuple[DeploymentPool, PoolFields]]:
    """The single-model pools, each with the config keys of its placement: `pools` as
    written, or those the flat fields describe (decode_ports, decode_gpus, ...)."""
    if d.pools:
        return [(p, PoolFields.of_yaml(f"pools[{i}]")) for i, p in enumerate(d.pools)]
    shorthand = [DeploymentPool("decode", "decode", list(d.decode_ports), d.router_policy,
                                gpus=list(d.decode_gpus),
                                gpu_memory_fraction=d.decode_gpu_memory_fraction)]
    if d.disagg:
        shorthand.append(DeploymentPool("prefill", "prefill", list(d.prefill_ports),
                                        d.router_policy, gpus=list(d.prefill_gpus),
                                        gpu_memory_fraction=d.prefill_gpu_memory_fraction))
    if d.encode_ports:
        # Round robin: the kv policy has nothing to match on an encode worker.
        shorthand.append(DeploymentPool("encode", "encode", list(d.encode_ports),
                                        gpus=list(d.encode_gpus),
                                        gpu_memory_fraction=d.encode_gpu_memory_fraction))
    if d.video_ports:
        shorthand.append(_video_pool(d))
    return [(p, PoolFields.flat(p.kind)) for p in shorthand]


def _video_pool(d: Deployment) -> DeploymentPool:
    # Least loaded: a video job holds its worker for seconds to minutes; the shortest queue
    # (reported running + waiting jobs) goes first.
    return DeploymentPool("video", "video", list(d.video_ports), "least_loaded",
                          gpus=list(d.video_gpus))


def router_ports(d: Deployment) -> dict[str, int]:
    """The single-model router process name -> its port: "router", or "router-0",
    "router-1", ... for several replicas (model_topologies has every model's)."""
    if d.router_replicas == 1:
        return {"router": d.router_port}
    return {f"router-{i}": d.router_port + i for i in range(d.router_replicas)}


def router_config(d: Deployment, topology: ModelTopology) -> dict[str, object]:
    """A router's YAML config (its model's pools with worker addresses, the grid)."""
    config: dict[str, object] = {
        "pools": [{"name": p.name, "kind": p.kind, "policy": p.policy,
                   "workers": [f"{d.host}:{port}" for port in p.ports]} for p in topology.pools],
        "block_size": topology.engine_args.kv_block_size,
        "metrics_port": d.router_metrics_port,
    }
    if d.grid_config:
        config["grid_config"] = str(pathlib.Path(d.grid_config).resolve())
    return config


def model_topologies(d: Deployment) -> list[ModelTopology]:
    """One per served model: the model the flat fields describe, or each of `models` (their
    pools named "<model>-<pool>", so that process names stay unique).

    Raises:
        InvalidRequest: a listed model without a name or pools, or a name twice.
    """
    if d.router_replicas < 1:
        raise InvalidRequest("router_replicas must be at least 1", param="router_replicas")
    if not d.models:
        placed = pools(d)
        return [ModelTopology(d.served_model_name, d.engine_args, [p for p, _ in placed],
                              router_ports(d), d.tool_call_parser, d.reasoning_parser,
                              pool_fields=[f for _, f in placed])]
    video = [_video_pool(d)] if d.video_ports else []
    topologies: list[ModelTopology] = []
    for k, m in enumerate(d.models):
        if not m.name or not m.pools:
            raise InvalidRequest(f"models[{k}] needs a name and pools", param=f"models[{k}]")
        if len({p.kind == "embedding" for p in m.pools}) > 1:
            raise InvalidRequest(f"models[{k}] mixes embedding pools with text pools; serve the "
                                 "embedding workers as a model of their own",
                                 param=f"models[{k}].pools")
        if any(t.name == m.name for t in topologies):
            raise InvalidRequest(f"models[{k}].name {m.name!r} is listed twice",
                                 param=f"models[{k}].name")
        base = d.router_port + k * d.router_replicas
        routers = ({f"router-{m.name}": base} if d.router_replicas == 1 else
                   {f"router-{m.name}-{i}": base + i for i in range(d.router_replicas)})
        engine_args = dataclasses.replace(
            d.engine_args, model=m.model, max_seq_len=m.max_seq_len or d.engine_args.max_seq_len)
        named = [dataclasses.replace(p, name=f"{m.name}-{p.name}") for p in m.pools]
        fields = [PoolFields.of_yaml(f"models[{k}].pools[{i}]") for i in range(len(m.pools))]
        if k == 0 and video:
            named, fields = [*named, *video], [*fields, PoolFields.flat("video")]
        topologies.append(ModelTopology(m.name, engine_args, named, routers, m.tool_call_parser,
                                        m.reasoning_parser, list(m.worker_flags), fields))
    return topologies
