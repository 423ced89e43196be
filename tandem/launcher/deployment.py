"""The deployment description: which services run, on which ports, with which engine. `tandem up`
starts it as local processes; compose and Kubernetes describe the same topology."""
from __future__ import annotations

import dataclasses
import pathlib
import socket
from dataclasses import dataclass, field

import yaml

from tandem.engines.args import EngineArgs
from tandem.errors import InvalidRequest
from tandem.launcher import placement
from tandem.launcher.served_models import (
    DeploymentModel,
    DeploymentPool,
    ModelTopology,
    model_topologies,
    router_config,
)
from tandem.launcher.supervisor import RESTART_POLICIES
from tandem.launcher.workers import (
    ServiceProcess,
    SharedFlags,
    model_workers,
    serve_argv,
    video_model_name,
)
from tandem.multimodal.fetch import MediaFetchConfig
from tandem.runtime import config as config_lib
from tandem.runtime.cores import usable_cores
from tandem.runtime.progress import WatchdogConfig
from tandem.runtime.tls import TlsConfig


@dataclass(frozen=True)
class Deployment:
    # == network ==
    #: Address every service binds to and is reached at.
    host: str = "127.0.0.1"
    #: The services talk over Unix-domain sockets in a private directory of this run (the
    #: addresses they advertise stay TCP); off, or with TLS: over TCP.
    unix_sockets: bool = True
    #: Frontend OpenAI REST port.
    http_port: int = 8000
    #: Frontend public gRPC Inference port.
    grpc_port: int = 8001
    #: Frontend processes sharing the HTTP and gRPC ports (SO_REUSEPORT: the kernel spreads
    #: connections among them), named frontend-0, frontend-1, ...; each also serves gRPC on a
    #: free port of its own, where the launcher checks that it is ready. 0: one per 4 cores
    #: this machine lets the launcher use, at most 4 (a burst of new requests is parsed,
    #: templated and tokenized in parallel; issue 25 measured TTFT at 128 streams on a
    #: 16-core GPU host: 1.7x the engine's with one frontend, 1.1x with four).
    frontend_processes: int = 0
    #: Router gRPC port.
    router_port: int = 9100
    #: Router processes, each with the whole index (every worker's event stream): replica i
    #: listens on router_port + i, and the frontend spreads its Route calls over all of them,
    #: failing over when one is down.
    router_replicas: int = 1
    #: One decode (aggregated) worker per port, in one pool (used when `pools` is empty).
    decode_ports: list[int] = field(default_factory=lambda: [9200])
    # == model and engine ==
    #: Engine backend of every worker: reference (PyTorch, real inference) or mock (no model
    #: compute, simulated timing: for load tests of the serving stack).
    engine: str = "reference"
    #: GPUs of each decode worker, one entry per decode_ports entry: GPU indices as the host
    #: numbers them (nvidia-smi), comma-separated: `--decode-gpus 0 1`, or `2,3` for a worker on
    #: two (TANDEM_DECODE_GPUS splits at commas: one GPU per worker there); a worker sees only
    #: its own (CUDA_VISIBLE_DEVICES). None: no placement (every worker sees every GPU).
    decode_gpus: list[str] = field(default_factory=list)
    #: GPUs of each prefill worker (--disagg), one entry per prefill_ports entry, as
    #: decode_gpus.
    prefill_gpus: list[str] = field(default_factory=list)
    #: GPUs of each encode worker, one entry per encode_ports entry, as decode_gpus.
    encode_gpus: list[str] = field(default_factory=list)
    #: GPUs of each video worker, one entry per video_ports entry, as decode_gpus (a video
    #: worker shares its GPU with no other worker).
    video_gpus: list[str] = field(default_factory=list)
    #: Fraction (0-1) of its GPU's memory each decode worker may hold (its
    #: --gpu-memory-fraction); workers that share a GPU each need one, summing to at most 1.
    #: 0: the whole GPU.
    decode_gpu_memory_fraction: float = 0.0
    #: Fraction (0-1) of its GPU's memory each prefill worker may hold, as
    #: decode_gpu_memory_fraction.
    prefill_gpu_memory_fraction: float = 0.0
    #: Fraction (0-1) of its GPU's memory each encode worker may hold, as
    #: decode_gpu_memory_fraction (an encode worker keeps no KV pool: the share only counts
    #: towards its GPU's total).
    encode_gpu_memory_fraction: float = 0.0
    #: Name clients pass as `model`; unset: the model directory's name.
    served_model_name: str = ""
    #: Frontend: parser of the model's tool-call markup (hermes, llama3_json, mistral,
    #: pythonic, deepseek_v3, harmony); "": none (tool_choice "auto" is refused).
    tool_call_parser: str = ""
    #: Frontend: parser that splits reasoning into reasoning_content (deepseek_r1, qwen3,
    #: gpt_oss); "": none.
    reasoning_parser: str = ""
    #: Frontend: whitespace characters structured outputs may put between two JSON tokens
    #: (0: compact JSON; at most 64).
    json_whitespace: int = 0
    # == routing ==
    #: The router's policy for the decode pool: round_robin, random, least_loaded,
    #: power_of_two or kv.
    router_policy: str = "round_robin"
    #: Frontend: route requests in its own process (a local router fed by the workers' streams,
    #: built from the router's list); off: every request asks a router replica.
    local_routing: bool = True
    #: Several pools (YAML only); replaces decode_ports / router_policy.
    pools: list[DeploymentPool] = field(default_factory=list)
    #: Several models behind one frontend (YAML only), each with its pools and its router
    #: (model i's router replicas listen on router_port + i * router_replicas + r); replaces
    #: pools, decode_ports, disagg, encode_ports, served_model_name, tool_call_parser and
    #: reasoning_parser. The video pools (video_ports) join the first model's router.
    models: list[DeploymentModel] = field(default_factory=list)
    #: Dynamo global-router JSON file with the SLA grid over `pools` (passed to the router).
    grid_config: str = ""
    # == disaggregation ==
    #: Disaggregated serving: also run one prefill worker per `prefill_ports` entry, in a
    #: prefill pool; decode workers read the prompt's KV from them over NIXL.
    disagg: bool = False
    #: Prefill worker ports, one worker per port (with --disagg).
    prefill_ports: list[int] = field(default_factory=lambda: [9300])
    #: Frontend: prompts whose uncached part is at most this many tokens skip the prefill
    #: worker (conditional disaggregation), tokens.
    max_local_prefill_length: int = 0
    # == multimodal ==
    #: One encode worker (vision tower and projector of a vision-language model) per port, in
    #: an encode pool; requests with images are encoded there. None: the prefill (or
    #: aggregated) worker encodes images itself.
    encode_ports: list[int] = field(default_factory=list)
    #: Frontend: limits on images in requests (--max-file-size-mb, --allowed-local-media-path,
    #: --allowed-media-networks, ...).
    media: MediaFetchConfig = field(default_factory=MediaFetchConfig)
    #: One video worker (text-to-video diffusion, `tandem serve video`) per port, in a video
    #: pool the router picks from by least load; the frontend serves /v1/videos. None: no
    #: video stage.
    video_ports: list[int] = field(default_factory=list)
    #: The video workers' model: a diffusers pipeline directory (Wan); unset: a tiny
    #: random-weight Wan generated on first use.
    video_model: str = ""
    #: Name clients pass as `model` to /v1/videos; unset: the video model directory's name.
    video_served_model_name: str = ""
    #: Video engine: reference (diffusers) or trtllm (TensorRT-LLM visual_gen).
    video_engine: str = "reference"
    #: Where video workers write MP4s; unset: their default (/tmp/tandem_media).
    media_output_dir: str = ""
    #: Extra flags for every video worker (e.g. --dtype bfloat16, --max-num-frames 161).
    video_worker_flags: list[str] = field(default_factory=list)
    # == reliability ==
    #: Seconds each service gets to drain on shutdown.
    grace_period_s: float = 30.0
    #: Frontend: longest a request may take end to end, seconds (then 504); 0: no limit.
    request_timeout_s: float = 0.0
    #: Frontend: times a request whose decode stream broke moves to another decode worker.
    migration_limit: int = 2
    #: Frontend admission control: requests sent on to workers at once; 0: no limit.
    frontend_max_inflight_requests: int = 4096
    #: Frontend admission control: requests waiting for one of those slots; past it, 429 with
    #: Retry-After; 0: no limit.
    frontend_max_queued_requests: int = 4096
    #: What `tandem up` does when a service exits while the topology runs: on-failure
    #: (restart it after a back-off of 0.5 s doubling to 30 s, as compose's `restart:` and
    #: Kubernetes do; `tandem status` shows the restart counts) or no (log it and leave it
    #: down).
    restart_policy: str = "on-failure"
    #: Workers: health that proves progress (--progress-timeout-s, --canary-interval-s, ...).
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    # == observability ==
    #: Router's Prometheus /metrics port; router process i (in start order: each model's
    #: replicas in turn) serves it on this port + i; 0: none.
    router_metrics_port: int = 0
    #: Frontend's plain-HTTP /metrics port (its OpenAI port serves /metrics too, of whichever
    #: process took the connection); frontend process i serves it on this port + i; 0: none.
    frontend_metrics_port: int = 0
    #: Workers' Prometheus /metrics ports, one per worker in start order (pool by pool as
    #: listed; without `pools`: the decode, then the prefill, then the encode workers); none:
    #: no worker metrics port.
    worker_metrics_ports: list[int] = field(default_factory=list)
    #: Least severe log level every service writes: debug, info, warning or error.
    log_level: str = "info"
    #: Log format of every service: text (one line per event, for a person), json (one object
    #: per line, for collectors) or auto (text when stderr is a terminal, else json).
    log_format: str = "auto"
    # == testing ==
    #: Workers: fault-test hooks (SIGUSR1 pauses the engine's step loop, SIGUSR2 resumes it).
    debug_hooks: bool = False
    # == general ==
    #: Also run the planner (`tandem serve planner`): every interval it sizes the pools that
    #: planner_config lists to their SLA targets, and this launcher adds their workers on free
    #: ports (and free GPU entries: a pool's spare_gpus) or drains the ones it removes.
    planner: bool = False
    #: The planner's plan: a YAML file of its pools (each a deployment pool's name, its role,
    #: TTFT/ITL targets, min/max workers, capacity profile), GPU budget and interval
    #: (tandem.planner.config); required with --planner.
    planner_config: str = ""
    #: The planner's Prometheus /metrics port (desired and actual workers per pool,
    #: decisions); 0: none.
    planner_metrics_port: int = 0
    # == security ==
    #: Frontend: API keys clients must send (--api-keys; $TANDEM_API_KEYS reaches the frontend
    #: through the environment).
    api_keys: list[str] = field(default_factory=list,
                                metadata={"secret": True, "env": False})
    #: Frontend: file of API keys, one per line.
    api_keys_file: str = ""
    #: TLS/mTLS of every service (--tls-cert-file, --tls-key-file, --tls-ca-file,
    #: --tls-require-client-cert, --tls-server-name), passed to each one.
    tls: TlsConfig = field(default_factory=TlsConfig)
    #: Engine flags, forwarded to every worker (--model, --speedup-ratio, --kv-block-size ...).
    engine_args: EngineArgs = field(default_factory=EngineArgs)


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
    return [*workers, *routers, *frontends(d, frontend_argv)]


def frontends(d: Deployment, argv: list[str]) -> list[ServiceProcess]:
    """One frontend process, or `frontend_processes` of them sharing the ports, each with its
    own gRPC port for the launcher's readiness check and its own metrics port."""
    if d.frontend_processes < 0:
        raise InvalidRequest("frontend_processes must be at least 1 (0: one per 4 cores)",
                             param="frontend_processes")
    count = d.frontend_processes or auto_frontend_processes()
    metrics = [["--metrics-port", str(d.frontend_metrics_port + i)] if d.frontend_metrics_port
               else [] for i in range(count)]
    if count == 1:
        return [ServiceProcess("frontend", f"{d.host}:{d.grpc_port}", [*argv, *metrics[0]],
                               is_dialed_by_peers=False)]
    own_ports = _free_ports(d.host, count)
    return [ServiceProcess(f"frontend-{i}", f"{d.host}:{port}",
                           [*argv, *metrics[i], "--reuse-port", "--own-grpc-port", str(port)],
                           stop_group="frontend", is_dialed_by_peers=False)
            for i, port in enumerate(own_ports)]


def auto_frontend_processes() -> int:
    """Frontend processes when none are asked for: one per 4 cores this process may run on,
    at most 4 (so 1 on a machine of fewer than 8 cores)."""
    return max(1, min(4, usable_cores() // 4))


def _free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports nothing listens on now (all held open until the end, so that the
    kernel offers each once)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for sock in held:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


def with_model(d: Deployment, model: str) -> Deployment:
    return dataclasses.replace(d, engine_args=dataclasses.replace(d.engine_args, model=model))
