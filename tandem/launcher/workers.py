"""The command lines of a deployment's workers: one per port of each pool at start
(`model_workers`), and one at a time for a worker a planner adds later (`pool_worker`, what
tandem.launcher.scaling starts), built the same way so that an added worker runs exactly as its
pool's first ones do."""
from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.launcher import placement
from tandem.launcher.deployment import Deployment, DeploymentPool
from tandem.launcher.served_models import ModelTopology
from tandem.runtime import config as config_lib


@dataclass(frozen=True)
class ServiceProcess:
    """One process of the topology: its name, gRPC health address, command line and the
    variables it gets on top of the launcher's environment."""

    name: str
    health_address: str
    argv: list[str]
    #: Processes of one group are stopped together (the frontend processes); "": its name.
    stop_group: str = ""
    #: Whether other services of the topology dial its gRPC port (workers, routers): it then
    #: gets a Unix-domain socket (tandem.runtime.unix_sockets); frontends are dialed by clients.
    is_dialed_by_peers: bool = True
    #: Set in its environment over the launcher's (a placed worker's CUDA_VISIBLE_DEVICES).
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SharedFlags:
    """Flags every service gets (`common`: grace period, logs, TLS) and every worker gets on top
    (`worker`: watchdog, debug hooks)."""

    common: list[str]
    worker: list[str]

    @classmethod
    def of(cls, d: Deployment) -> SharedFlags:
        common = ["--grace-period-s", str(d.grace_period_s), "--log-level", d.log_level,
                  "--log-format", d.log_format, *config_lib.to_argv(d.tls)]
        worker = [*config_lib.to_argv(d.watchdog), *(["--debug-hooks"] if d.debug_hooks else [])]
        return cls(common, worker)


def serve_argv(stage: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "serve", stage, *flags]


def video_model_name(d: Deployment) -> str:
    """The served name of the video model (what /v1/videos requests name)."""
    if d.video_served_model_name:
        return d.video_served_model_name
    return pathlib.Path(d.video_model).name if d.video_model else "tandem-wan-tiny"


def _video_worker(d: Deployment, name: str, port: int, common: list[str],
                  worker_flags: list[str], env: dict[str, str]) -> ServiceProcess:
    flags = ["--engine", d.video_engine, "--served-model-name", video_model_name(d)]
    flags += ["--model", d.video_model] if d.video_model else []
    flags += ["--media-output-dir", d.media_output_dir] if d.media_output_dir else []
    return ServiceProcess(name, f"{d.host}:{port}", serve_argv(
        "video", "--host", d.host, "--port", str(port), *flags, *common, *worker_flags,
        *d.video_worker_flags), env=env)


def _worker_stage(pool: DeploymentPool, disaggregated: bool) -> list[str]:
    if pool.kind in ("prefill", "encode"):
        return [pool.kind]
    if pool.kind == "embedding":
        return ["embed"]
    return ["decode", "--disaggregation-mode", "decode" if disaggregated else "agg"]


def pool_worker(d: Deployment, t: ModelTopology, pool: DeploymentPool, flags: SharedFlags,
                name: str, port: int, gpus: Sequence[int] = ()) -> ServiceProcess:
    """The process of one worker of `pool` (of model `t`) on `port`, seeing `gpus` (host
    indices; (): not placed)."""
    env = placement.gpu_env(gpus)
    if pool.kind == "video":
        return _video_worker(d, name, port, flags.common, [*flags.worker, *pool.worker_flags],
                             env)
    model = ["--served-model-name", t.name] if t.name else []
    disaggregated = any(p.kind == "prefill" for p in t.pools)
    # The pool's share after the model's flags, before the pool's own (they win).
    return ServiceProcess(name, f"{d.host}:{port}", serve_argv(
        *_worker_stage(pool, disaggregated), "--host", d.host, "--port", str(port),
        "--engine", d.engine, *model, *flags.common, *config_lib.to_argv(t.engine_args),
        *flags.worker, *t.worker_flags, *placement.fraction_flags(pool), *pool.worker_flags),
        env=env)


def model_workers(d: Deployment, t: ModelTopology, flags: SharedFlags
                  ) -> tuple[list[ServiceProcess], list[placement.PlacedWorker]]:
    """The model's workers, pool by pool, and where each is placed (placement.pool_gpus
    validates each pool's GPUs and share)."""
    workers: list[ServiceProcess] = []
    placed: list[placement.PlacedWorker] = []
    for pool, fields in zip(t.pools, t.pool_fields, strict=True):
        gpus = placement.pool_gpus(pool, fields, d.engine, t.engine_args.device,
                                   t.engine_args.tensor_parallel_size)
        for i, port in enumerate(pool.ports):
            worker_gpus = gpus[i] if gpus else ()
            workers.append(pool_worker(d, t, pool, flags, f"{pool.name}-{i}", port, worker_gpus))
            placed.append(placement.PlacedWorker(
                workers[-1].name, worker_gpus, placement.argv_fraction(workers[-1].argv),
                fields, takes_share=pool.kind != "video"))
    return workers, placed
