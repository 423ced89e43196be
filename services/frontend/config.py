"""The frontend's typed configuration (`tandem serve frontend` flags, its YAML --config).

Its own module so that the supervisor of several frontend processes, the launcher and the tests
read it without the serving code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.multimodal.fetch import MediaFetchConfig
from tandem.runtime.tls import TlsConfig

#: What a served model's workers do (ServedModelConfig.kind, --model-kind).
MODEL_KINDS = ("text", "embedding")


@dataclass(frozen=True)
class ServedModelConfig:
    """One model of a frontend that serves several (FrontendConfig.models)."""

    #: Name clients pass as `model` (required, unique).
    name: str = ""
    #: Model directory (tokenizer, chat template, config.json); unset: the demo model.
    model: str = ""
    #: Context length, tokens; 0: the model's max_position_embeddings.
    max_seq_len: int = 0
    #: This model's router replicas, as --router-address (required): each model has a router
    #: of its own, over its own pools and KV index.
    router_address: str = ""
    #: As --tool-call-parser, for this model.
    tool_call_parser: str = ""
    #: As --reasoning-parser, for this model.
    reasoning_parser: str = ""
    #: As --model-kind: text or embedding.
    kind: str = "text"


@dataclass(frozen=True)
class FrontendConfig:
    # == network ==
    #: Address the HTTP and gRPC ports bind to (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    #: OpenAI REST API port.
    http_port: int = 8000
    #: Public gRPC Inference API port.
    grpc_port: int = 8001
    #: Frontend processes serving the HTTP and gRPC ports together (SO_REUSEPORT: the kernel
    #: spreads connections among them). Above 1, this process starts that many children, each
    #: with --reuse-port (and --metrics-port plus its index), stops them all on SIGTERM, and
    #: exits non-zero when one of them dies.
    processes: int = 1
    #: Bind the HTTP and gRPC ports with SO_REUSEPORT, sharing them with the other frontend
    #: processes of this host; off, a port already taken fails start-up.
    reuse_port: bool = False
    #: A gRPC port of this process alone (health and the API), so that a launcher can tell
    #: whether this process is ready when several share --grpc-port; 0: none.
    own_grpc_port: int = 0
    #: Largest accepted HTTP request body, bytes (more: 413).
    max_request_bytes: int = 32 * 1024 * 1024
    #: Largest gRPC message the public gRPC port accepts or sends, bytes.
    max_message_bytes: int = 64 * 1024 * 1024
    # == model and engine ==
    #: Model directory (tokenizer and config.json); unset: the generated demo model.
    model: str = ""
    #: Name clients pass as `model`; unset: the model directory's name.
    served_model_name: str = ""
    #: Context length, tokens; 0: the model's max_position_embeddings.
    max_seq_len: int = 0
    #: Most messages in one chat request (more: 400).
    max_messages: int = 1000
    #: Responses API: most responses kept for GET /v1/responses/{id} and previous_response_id,
    #: in this process's memory (lost on restart; least recently used evicted first); 0: none
    #: kept. With --reuse-port (several processes) none are kept either.
    responses_store_size: int = 1000
    #: What the model's workers serve: text (chat and completions; decode, prefill and encode
    #: pools) or embedding (/v1/embeddings; an embedding pool).
    model_kind: str = "text"
    #: Served name of an embedding model behind the same router's embedding pool, beside the
    #: text model: /v1/embeddings serves it and /v1/models lists it; "": none.
    embedding_model: str = ""
    #: That embedding model's directory (its tokenizer and sentence-transformers files).
    embedding_model_path: str = ""
    #: Several models behind this frontend (YAML only, --config): requests go to the model
    #: they name, each model with its own tokenizer, chat template, parsers and router;
    #: replaces model, served_model_name, max_seq_len, router_address, tool_call_parser and
    #: reasoning_parser. Empty: the one model those flags describe.
    models: list[ServedModelConfig] = field(default_factory=list)
    #: Parser of the model's tool-call markup for tool_choice "auto": hermes (Qwen2.5/Qwen3,
    #: Hermes), llama3_json (Llama 3.1+), mistral, pythonic (Llama 4, Llama 3.2), deepseek_v3
    #: (DeepSeek-V3/R1) or harmony (gpt-oss, with --reasoning-parser gpt_oss); "": none, and
    #: requests that leave the choice to the model get a 400 (tool_choice required or a named
    #: function still works: a JSON grammar enforces it).
    tool_call_parser: str = ""
    #: Parser that splits reasoning off into reasoning_content: deepseek_r1 (DeepSeek-R1, Qwen3
    #: Thinking-2507), qwen3 (Qwen3 with enable_thinking) or gpt_oss; "": none.
    reasoning_parser: str = ""
    #: Whitespace characters structured outputs may put between two tokens of their JSON
    #: (json_schema, json_object, a forced tool call's arguments), at most 64; 0: compact JSON
    #: (", " and ": ", no newlines), as OpenAI's structured outputs come. A model free to
    #: choose whitespace may spend its whole max_tokens on newlines between keys.
    json_whitespace: int = 0
    # == routing ==
    #: The router replicas' gRPC addresses, host:port, comma-separated. Route calls are spread
    #: over every replica that is up and fail over between them; while none answers, the
    #: frontend routes alone on the last worker list a router gave it (least loaded, no kv
    #: index), says so in a log line and tandem_frontend_router_fallback, and goes back to the
    #: routers as soon as one says SERVING.
    router_address: str = "127.0.0.1:9100"
    #: Served name of the video model behind the router's video pool: /v1/videos serves it and
    #: /v1/models lists it (kind "video"); "": no video API.
    video_model: str = ""
    #: Longest wait for the router's answer, seconds.
    router_timeout_s: float = 10.0
    #: Route requests in this process (no Route round trip): a local router built from the
    #: router replicas' worker list and settings, fed by the workers' own health and KV event
    #: streams, deciding as a router replica does, the kv index included, and going on while
    #: every router replica is down. Off (--no-local-routing): every request asks a replica.
    local_routing: bool = True
    #: Tokens per KV block: the workers' --kv-block-size. The frontend hashes the blocks of
    #: prompts with images for the router, which must match the workers' hashes.
    kv_block_size: int = 32
    #: Send every request for one decode worker over one Decode.Session stream, which carries
    #: all of a step's tokens in one message; off (--no-decode-sessions): one Decode.Generate
    #: call per request, one message per request per step.
    decode_sessions: bool = True
    # == disaggregation ==
    #: Conditional disaggregation (as TensorRT-LLM's disaggregated server): prompts whose part
    #: not cached on the decode worker is at most this many tokens skip the prefill worker.
    max_local_prefill_length: int = 0
    #: Late binding of prompts to prefill workers: most prompt tokens this frontend has sent a
    #: prefill worker and not had answered (a prompt always fits a worker with none). A prompt
    #: that finds no worker with room waits here, first come first served, and goes to the
    #: first worker that frees room or joins, instead of queueing behind the router's pick;
    #: 0: off (every prompt goes to the router's pick at once).
    prefill_queue_tokens: int = 0
    # == reliability ==
    #: Admission control: most requests sent on to workers at once; 0: no limit.
    max_inflight_requests: int = 4096
    #: Most requests waiting for one of those slots (first come, first served); past it the
    #: frontend answers 429 with Retry-After (gRPC: RESOURCE_EXHAUSTED).
    max_queued_requests: int = 4096
    #: Longest a request may take end to end, seconds (then 504 / DEADLINE_EXCEEDED); 0: none.
    request_timeout_s: float = 0.0
    #: Times a request whose decode stream broke (worker died, stream failed) moves to another
    #: decode worker, resuming after the tokens it already has; 0: never (the client gets the
    #: error).
    migration_limit: int = 2
    #: Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    grace_period_s: float = 30.0
    # == multimodal ==
    #: Limits on images in requests (--max-file-size-mb, --media-fetch-timeout-s,
    #: --max-media-redirects, --allowed-local-media-path, --allowed-media-networks).
    media: MediaFetchConfig = field(default_factory=MediaFetchConfig)
    # == security ==
    #: API keys clients must send (`Authorization: Bearer <key>`); with --api-keys-file and
    #: $TANDEM_API_KEYS (all three together). None anywhere: no authentication.
    api_keys: list[str] = field(default_factory=list,
                                metadata={"secret": True, "env": False})
    #: File of API keys, one per line ('#' starts a comment line).
    api_keys_file: str = ""
    #: TLS on the HTTP and gRPC ports, TLS/mTLS on the channels to router and workers (--tls-*).
    tls: TlsConfig = field(default_factory=TlsConfig)
    #: With --tls-require-client-cert, leave the HTTPS port asking no client certificate (API
    #: keys alone authenticate its clients, e.g. behind a load balancer that ends TLS with
    #: certificates of its own); the gRPC ports stay mTLS.
    http_no_client_cert: bool = False
    # == observability ==
    #: Plain-HTTP port that serves only /metrics, for scrapers that should not reach the API
    #: (or its TLS); 0: none. The OpenAI port serves /metrics too.
    metrics_port: int = 0
    #: Least severe log level written: debug, info, warning or error.
    log_level: str = "info"
    #: Log format: text (one line per event, for a person), json (one object per line, for
    #: collectors) or auto (text when stderr is a terminal, else json).
    log_format: str = "auto"
