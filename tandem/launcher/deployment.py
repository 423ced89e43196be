"""The deployment description: which services run, on which ports, with which engine. `tandem up`
starts it as local processes (tandem.launcher.processes lists them); compose and Kubernetes
describe the same topology."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tandem.engines.args import EngineArgs
from tandem.multimodal.fetch import MediaFetchConfig
from tandem.runtime.progress import WatchdogConfig
from tandem.runtime.tls import TlsConfig


@dataclass(frozen=True)
class DeploymentPool:
    """A pool of workers the launcher starts and the router picks among."""

    name: str = "decode"
    #: decode, agg (aggregated grid pools), prefill, encode, video (`tandem serve video`) or
    #: embedding (`tandem serve embed`: an embedding model's workers, /v1/embeddings).
    kind: str = "decode"
    #: One worker per port.
    ports: list[int] = field(default_factory=list)
    #: The router's worker policy in this pool.
    policy: str = "round_robin"
    #: Extra flags for this pool's workers (after the shared engine flags, so they win), e.g.
    #: a different --speedup-ratio for a faster pool.
    worker_flags: list[str] = field(default_factory=list)
    #: GPUs of each worker, one entry per port in order: a comma-separated list of GPU indices
    #: as the host numbers them (nvidia-smi), quoted in YAML: ["0", "1"], or ["2,3"] for one
    #: worker on two. A worker sees only its GPUs (CUDA_VISIBLE_DEVICES). Empty: no placement
    #: (each worker sees every GPU the launcher sees and takes the first).
    gpus: list[str] = field(default_factory=list)
    #: Share (0-1) of its GPU's memory each worker of this pool may hold, passed on as its
    #: --gpu-memory-fraction (the reference engine sizes its KV pool by it); on a GPU that
    #: several workers share, each needs one and they sum to at most 1. 0: the whole GPU.
    gpu_memory_fraction: float = 0.0
    #: GPU entries (as `gpus`) for the workers a planner may add to this pool beyond its ports
    #: (`tandem up --planner`): an added worker takes the first entry no worker of the pool
    #: holds, and a removed worker's entry is free again. A placed pool grows no further than
    #: its entries. An entry shares a GPU only as `gpus` entries may (with the pool's
    #: gpu_memory_fraction, all shares on the GPU summing to at most 1).
    spare_gpus: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DeploymentModel:
    """One model of a deployment that serves several (Deployment.models, YAML only): its
    workers in pools of their own, behind a router of its own; the frontend serves them all
    and sends each request to the model it names."""

    #: Name clients pass as `model` (required, unique).
    name: str = ""
    #: Model directory; unset: the demo model.
    model: str = ""
    #: Its pools (decode, agg, prefill, encode), each with its ports (required).
    pools: list[DeploymentPool] = field(default_factory=list)
    #: Context length, tokens; 0: the model's max_position_embeddings.
    max_seq_len: int = 0
    #: Frontend: tool-call parser for this model (as tool_call_parser).
    tool_call_parser: str = ""
    #: Frontend: reasoning parser for this model (as reasoning_parser).
    reasoning_parser: str = ""
    #: Extra flags for every worker of this model (after the shared engine flags).
    worker_flags: list[str] = field(default_factory=list)


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
    #: Frontend: late binding of prompts to prefill workers, the most prompt tokens a
    #: frontend sends a prefill worker unanswered (more wait in the frontend for the first
    #: worker with room, new ones included); 0: off.
    frontend_prefill_queue_tokens: int = 0
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


def with_model(d: Deployment, model: str) -> Deployment:
    return dataclasses.replace(d, engine_args=dataclasses.replace(d.engine_args, model=model))
