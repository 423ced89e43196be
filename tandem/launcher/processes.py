"""The processes of a deployment in start order (workers, routers, frontends) with their command
lines, and the routers' config files they read."""
from __future__ import annotations

import pathlib
import socket

import yaml

from tandem.errors import InvalidRequest
from tandem.launcher import placement
from tandem.launcher.deployment import Deployment
from tandem.launcher.served_models import ModelTopology, model_topologies, router_config
from tandem.launcher.supervisor import RESTART_POLICIES
from tandem.launcher.workers import (
    ServiceProcess,
    SharedFlags,
    model_workers,
    serve_argv,
    video_model_name,
)
from tandem.runtime import config as config_lib
from tandem.runtime.cores import usable_cores


def _router_address(d: Deployment, t: ModelTopology) -> str:
    return ",".join(f"{d.host}:{port}" for port in t.routers.values())


def _model_flags(d: Deployment, topologies: list[ModelTopology],
                 workdir: pathlib.Path) -> list[str]:
    """The frontend's flags for its model(s): flat flags for one, a --config file listing
    them for several (written into `workdir`)."""
    if not d.models:
        t = topologies[0]
        flags = ["--router-address", _router_address(d, t)]
        flags += ["--model", t.engine_args.model] if t.engine_args.model else []
        flags += ["--served-model-name", t.name] if t.name else []
        flags += ["--max-seq-len", str(t.engine_args.max_seq_len)] if t.engine_args.max_seq_len \
            else []
        flags += ["--tool-call-parser", t.tool_call_parser] if t.tool_call_parser else []
        flags += ["--reasoning-parser", t.reasoning_parser] if t.reasoning_parser else []
        flags += ["--model-kind", t.kind] if t.kind != "text" else []
        return flags
    models = [{"name": t.name, "model": t.engine_args.model, "max_seq_len": t.engine_args.max_seq_len,
               "router_address": _router_address(d, t), "tool_call_parser": t.tool_call_parser,
               "reasoning_parser": t.reasoning_parser, "kind": t.kind} for t in topologies]
    path = workdir / "frontend-models.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return ["--config", str(path)]


def processes(d: Deployment, workdir: pathlib.Path) -> list[ServiceProcess]:
    """The processes in start order (workers, routers, frontend); stop in reverse. The
    routers' config files are written into `workdir`."""
    flags = SharedFlags.of(d)
    common = flags.common
    topologies = model_topologies(d)
    if d.engine == "mock" and any(p.kind == "encode" for t in topologies for p in t.pools):
        raise InvalidRequest("encode workers need a vision encoder, which the mock engine does "
                             "not have: use --engine reference with a vision model",
                             param="encode_ports")
    if d.engine == "mock" and any(t.kind == "embedding" for t in topologies):
        raise InvalidRequest("embedding workers need a model's hidden states, which the mock "
                             "engine does not compute: use --engine reference", param="engine")
    if d.restart_policy not in RESTART_POLICIES:
        raise InvalidRequest(f"restart_policy must be one of {', '.join(RESTART_POLICIES)}, "
                             f"got {d.restart_policy!r}", param="restart_policy")
    workers: list[ServiceProcess] = []
    placed: list[placement.PlacedWorker] = []
    for t in topologies:
        model_processes, model_placed = model_workers(d, t, flags)
        workers += model_processes
        placed += model_placed
    placement.check_shared_gpus(placed)
    if d.worker_metrics_ports:
        if len(d.worker_metrics_ports) != len(workers):
            raise InvalidRequest(f"worker_metrics_ports lists {len(d.worker_metrics_ports)} "
                                 f"ports for {len(workers)} workers", param="worker_metrics_ports")
        for worker, metrics_port in zip(workers, d.worker_metrics_ports):
            worker.argv.extend(["--metrics-port", str(metrics_port)])
    routers: list[ServiceProcess] = []
    for t in topologies:
        router_file = workdir / (f"router-{t.name}.yaml" if d.models else "router.yaml")
        router_file.write_text(yaml.safe_dump(router_config(d, t)))
        for name, port in t.routers.items():
            # Router process j serves its metrics on router_metrics_port + j (the config file
            # its model's replicas share names the first): one port each, as frontends have.
            metrics = ["--metrics-port", str(d.router_metrics_port + len(routers))] \
                if d.router_metrics_port else []
            routers.append(ServiceProcess(name, f"{d.host}:{port}", serve_argv(
                "router", "--host", d.host, "--port", str(port), "--config", str(router_file),
                *metrics, *common)))
    frontend_flags = _model_flags(d, topologies, workdir)
    if d.request_timeout_s:
        frontend_flags += ["--request-timeout-s", str(d.request_timeout_s)]
    frontend_flags += ["--max-inflight-requests", str(d.frontend_max_inflight_requests),
                       "--max-queued-requests", str(d.frontend_max_queued_requests)]
    if d.max_local_prefill_length:
        frontend_flags += ["--max-local-prefill-length", str(d.max_local_prefill_length)]
    frontend_flags += ["--migration-limit", str(d.migration_limit)]
    if d.frontend_prefill_queue_tokens:
        frontend_flags += ["--prefill-queue-tokens", str(d.frontend_prefill_queue_tokens)]
    if any(p.kind == "video" for p in topologies[0].pools):
        frontend_flags += ["--video-model", video_model_name(d)]
    if d.json_whitespace:
        frontend_flags += ["--json-whitespace", str(d.json_whitespace)]
    if not d.local_routing:
        frontend_flags.append("--no-local-routing")
    if d.api_keys:
        frontend_flags += ["--api-keys", *d.api_keys]
    if d.api_keys_file:
        frontend_flags += ["--api-keys-file", str(pathlib.Path(d.api_keys_file).resolve())]
    # The frontend hashes prompts with images into the workers' blocks.
    frontend_flags += ["--kv-block-size", str(d.engine_args.kv_block_size),
                       *config_lib.to_argv(d.media)]
    frontend_argv = serve_argv(
        "frontend", "--host", d.host, "--http-port", str(d.http_port), "--grpc-port",
        str(d.grpc_port), *frontend_flags, *common, "--processes", "1")
    planned = {int(p.health_address.rpartition(":")[2]) for p in [*workers, *routers]}
    return [*workers, *routers, *frontends(d, frontend_argv, planned)]


def frontends(d: Deployment, argv: list[str], planned: set[int] | None = None
              ) -> list[ServiceProcess]:
    """One frontend process, or `frontend_processes` of them sharing the ports, each with its
    own gRPC port for the launcher's readiness check (none of `planned`, the ports the other
    services will listen on but may not yet) and its own metrics port."""
    if d.frontend_processes < 0:
        raise InvalidRequest("frontend_processes must be at least 1 (0: one per 4 cores)",
                             param="frontend_processes")
    count = d.frontend_processes or auto_frontend_processes()
    metrics = [["--metrics-port", str(d.frontend_metrics_port + i)] if d.frontend_metrics_port
               else [] for i in range(count)]
    if count == 1:
        return [ServiceProcess("frontend", f"{d.host}:{d.grpc_port}", [*argv, *metrics[0]],
                               is_dialed_by_peers=False)]
    metrics_ports = (set(range(d.frontend_metrics_port, d.frontend_metrics_port + count))
                     if d.frontend_metrics_port else set())
    own_ports = _free_ports(d.host, count,
                            {*(planned or ()), d.http_port, d.grpc_port, *metrics_ports})
    return [ServiceProcess(f"frontend-{i}", f"{d.host}:{port}",
                           [*argv, *metrics[i], "--reuse-port", "--own-grpc-port", str(port)],
                           stop_group="frontend", is_dialed_by_peers=False)
            for i, port in enumerate(own_ports)]


def auto_frontend_processes() -> int:
    """Frontend processes when none are asked for: one per 4 cores this process may run on,
    at most 4 (so 1 on a machine of fewer than 8 cores)."""
    return max(1, min(4, usable_cores() // 4))


def _free_ports(host: str, n: int, avoid: set[int]) -> list[int]:
    """`n` distinct ports nothing listens on now and none of `avoid` (ports planned for
    services that have not bound them yet: the kernel could offer them too). All are held
    open until the end, so that the kernel offers each once."""
    held: list[socket.socket] = []
    try:
        while len([s for s in held if s.getsockname()[1] not in avoid]) < n:
            sock = socket.socket()
            held.append(sock)
            sock.bind((host, 0))
        return [s.getsockname()[1] for s in held if s.getsockname()[1] not in avoid][:n]
    finally:
        for sock in held:
            sock.close()
