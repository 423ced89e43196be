"""The deployment description: which services run, on which ports, with which engine. `tandem up`
starts it as local processes; compose and Kubernetes describe the same topology."""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from tandem.engines.args import EngineArgs
from tandem.runtime import config as config_lib


@dataclass(frozen=True)
class Deployment:
    host: str = "127.0.0.1"
    #: Engine backend of every worker: "reference" (PyTorch, real inference) or "mock" (no model
    #: compute, simulated timing: for load tests of the serving stack).
    engine: str = "reference"
    #: Name clients pass as `model`; default: the model directory's name.
    served_model_name: str = ""
    #: Frontend OpenAI REST port.
    http_port: int = 8000
    #: Frontend public gRPC Inference port.
    grpc_port: int = 8001
    router_port: int = 9100
    #: One decode (aggregated) worker per port.
    decode_ports: list[int] = field(default_factory=lambda: [9200])
    #: Seconds each service gets to drain on shutdown.
    grace_period_s: float = 30.0
    #: Frontend: longest a request may take end to end, seconds (then 504); 0: no limit.
    request_timeout_s: float = 0.0
    log_level: str = "info"
    #: Engine flags, forwarded to every worker (--model, --speedup-ratio, --kv-block-size ...).
    engine_args: EngineArgs = field(default_factory=EngineArgs)


@dataclass(frozen=True)
class ServiceProcess:
    """One process of the topology: its name, gRPC health address and command line."""

    name: str
    health_address: str
    argv: list[str]


def _serve(stage: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "serve", stage, *flags]


def processes(d: Deployment) -> list[ServiceProcess]:
    """The processes in start order (workers, router, frontend); stop in reverse."""
    common = ["--grace-period-s", str(d.grace_period_s), "--log-level", d.log_level]
    model = ["--served-model-name", d.served_model_name] if d.served_model_name else []
    engine_flags = config_lib.to_argv(d.engine_args)
    workers = [ServiceProcess(f"decode-{i}", f"{d.host}:{port}", _serve(
        "decode", "--host", d.host, "--port", str(port), "--engine", d.engine, *model, *common,
        *engine_flags)) for i, port in enumerate(d.decode_ports)]
    router = ServiceProcess("router", f"{d.host}:{d.router_port}", _serve(
        "router", "--host", d.host, "--port", str(d.router_port), "--decode-workers",
        *(f"{d.host}:{p}" for p in d.decode_ports), *common))
    frontend_flags = ["--model", d.engine_args.model] if d.engine_args.model else []
    if d.engine_args.max_seq_len:
        frontend_flags += ["--max-seq-len", str(d.engine_args.max_seq_len)]
    if d.request_timeout_s:
        frontend_flags += ["--request-timeout-s", str(d.request_timeout_s)]
    frontend = ServiceProcess("frontend", f"{d.host}:{d.grpc_port}", _serve(
        "frontend", "--host", d.host, "--http-port", str(d.http_port), "--grpc-port",
        str(d.grpc_port), "--router-address", f"{d.host}:{d.router_port}", *model,
        *frontend_flags, *common))
    return [*workers, router, frontend]


def with_model(d: Deployment, model: str) -> Deployment:
    return dataclasses.replace(d, engine_args=dataclasses.replace(d.engine_args, model=model))
