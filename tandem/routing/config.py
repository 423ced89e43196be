"""Typed router configuration (defaults < YAML < flags, like every service)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.runtime.tls import TlsConfig

POOL_KINDS = ("decode", "prefill", "agg", "encode", "video", "embedding")
#: Pools whose worker takes a whole request alone, without tokens or KV to match: a request
#: for one of these is routed to that kind of pool only (RouteRequest.video, .embedding).
WHOLE_REQUEST_KINDS = ("video", "embedding")


@dataclass(frozen=True)
class PoolConfig:
    """One pool of workers and how the router picks among them."""

    name: str = ""
    #: decode, prefill (disaggregated grid pools), agg (aggregated grid pools), encode
    #: (vision encoders, asked only for requests with images), video (diffusion workers,
    #: asked only for video requests) or embedding (embedding models' workers, asked only
    #: for embedding requests).
    kind: str = "decode"
    #: Static worker addresses, host:port (each address is also the worker's id).
    workers: list[str] = field(default_factory=list)
    #: Or a DNS name with port (a Kubernetes headless Service), re-resolved periodically.
    dns: str = ""
    #: round_robin, random, least_loaded, power_of_two or kv.
    policy: str = "round_robin"
    #: kv policy: weight of prefill work against decode load. 2 rather than the formula's
    #: neutral 1: with 1, a worker already holding a long prefix loses it to an idle cold
    #: worker as soon as it carries one more request, and prefix-heavy traffic then misses its
    #: cache half the time (benchmarks/RESULTS.md, "Router: prefix-heavy workload").
    prefill_load_scale: float = 2.0
    #: kv policy: 0 picks the cheapest; > 0 samples by softmax over -cost / temperature.
    temperature: float = 0.0
    #: kv policy: cost of a prefix block a worker holds in its host KV tier (copied back, not
    #: recomputed) as a share of recomputing it, 0..1; a device hit costs 0. 0.3: copying a
    #: block's KV over PCIe takes about a third of the time to prefill it
    #: (tandem.routing.policies.DEFAULT_HOST_HIT_COST gives the figures).
    host_hit_cost: float = 0.3


@dataclass(frozen=True)
class RouterConfig:
    # == network ==
    #: Address the router's gRPC port binds to (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    #: The router's gRPC port (Router API, health, reflection).
    port: int = 9100
    #: Largest gRPC message the router's port accepts or sends, bytes.
    max_message_bytes: int = 64 * 1024 * 1024
    # == routing ==
    #: Shorthand for one decode pool of these worker addresses, host:port (used when `pools`
    #: is empty).
    decode_workers: list[str] = field(default_factory=list)
    #: Policy of that shorthand pool: round_robin, random, least_loaded, power_of_two or kv.
    policy: str = "round_robin"
    #: Pools (YAML only); the grid's pool indices count prefill, decode and agg pools each in
    #: the order they are listed here.
    pools: list[PoolConfig] = field(default_factory=list)
    #: Dynamo global-router JSON file with the SLA grid; unset: the first pool serves
    #: everything, the others are its retry order.
    grid_config: str = ""
    #: Tokens per KV block: the workers' --kv-block-size (prefix hashes must match theirs).
    block_size: int = 32
    #: Cap on the expected output length used for the decode context length, tokens.
    typical_osl: int = 1024
    #: Seconds between DNS re-resolutions of `dns` pools.
    dns_refresh_s: float = 10.0
    # == reliability ==
    #: Seconds in-flight calls get to finish after SIGTERM.
    grace_period_s: float = 30.0
    #: Longest a (re)started router waits for every worker's event stream to replay its cache
    #: into the index before it takes Route calls anyway, seconds (a worker that cannot be
    #: reached, or is starting, is not waited for).
    startup_sync_timeout_s: float = 10.0
    # == observability ==
    #: Port of the Prometheus /metrics endpoint; 0: none.
    metrics_port: int = 0
    #: Least severe log level written: debug, info, warning or error.
    log_level: str = "info"
    #: Log format: text (one line per event, for a person), json (one object per line, for
    #: collectors) or auto (text when stderr is a terminal, else json).
    log_format: str = "auto"
    # == security ==
    #: TLS/mTLS on the router's port and on its channels to workers (--tls-*).
    tls: TlsConfig = field(default_factory=TlsConfig)

    def resolved_pools(self) -> list[PoolConfig]:
        if self.pools:
            return self.pools
        return [PoolConfig(name="decode", kind="decode", workers=list(self.decode_workers),
                           policy=self.policy)]
