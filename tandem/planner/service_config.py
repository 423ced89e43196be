"""`tandem serve planner`'s typed configuration: where it reads metrics, how it acts, and the plan
(tandem.planner.config.PlannerConfig: pools, targets, bounds, GPU budget, interval) under
`plan`. Built as every service's config is (defaults < --config YAML < TANDEM_* < flags)::

    frontend_metrics_urls: [http://127.0.0.1:9090/metrics]
    router_metrics_urls: [http://127.0.0.1:9190/metrics]
    connector: local
    launcher_address: unix:/tmp/tandem-up-x/launcher.sock
    plan:
      interval_s: 30
      gpu_budget: 8
      pools:
        - {name: decode, role: agg, ttft_target_ms: 500, itl_target_ms: 50, max_workers: 6,
           profile: profiles/decode.json}

The plan's scalar fields are flags too (--interval-s, --gpu-budget, --scale-down-intervals ...);
its pools come from the YAML only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidRequest
from tandem.planner.config import PlannerConfig
from tandem.planner.demand import PoolModel, check_model
from tandem.planner.profile import read_profile
from tandem.runtime.tls import TlsConfig


@dataclass(frozen=True)
class PlannerServiceConfig:
    # == network ==
    #: Address the planner's gRPC port binds to.
    host: str = "127.0.0.1"
    #: The planner's gRPC port: grpc.health.v1 (SERVING while it plans) and reflection only.
    port: int = 9400
    # == general ==
    #: Prometheus pages of every frontend process (URLs): request rate, ISL/OSL, TTFT and ITL.
    frontend_metrics_urls: list[str] = field(default_factory=list)
    #: Prometheus pages of the router (URLs; one replica's is enough, each follows every
    #: worker): each pool's workers, their load and the KV blocks each holds.
    router_metrics_urls: list[str] = field(default_factory=list)
    #: Prometheus pages of workers (URLs, optional): their running and waiting requests and
    #: KV use, logged with each decision (workers a planner adds have none listed here).
    worker_metrics_urls: list[str] = field(default_factory=list)
    #: The served model whose traffic sizes the pools (the frontend's `model` label); "":
    #: all of the frontend's traffic.
    model: str = ""
    #: How the planner acts on the deployment: local (a `tandem up` launcher's control API),
    #: kubernetes (the pools' Deployments) or kubernetes-read-only (services.planner.main).
    connector: str = "local"
    #: The launcher's control API (connector local): unix:/path or host:port.
    launcher_address: str = ""
    #: File the planner keeps its targets and last decisions in, as JSON (`tandem status`
    #: shows it); "": none.
    status_file: str = ""
    #: Longest wait for one metrics page, seconds.
    scrape_timeout_s: float = 5.0
    #: The pools the planner sizes, their targets and bounds, the GPU budget and the interval.
    plan: PlannerConfig = field(default_factory=PlannerConfig)
    # == reliability ==
    #: Seconds the gRPC port gets to close on SIGTERM (the planner holds no request).
    grace_period_s: float = 5.0
    # == observability ==
    #: Port of the planner's Prometheus /metrics (desired and actual workers per pool,
    #: decisions); 0: none.
    metrics_port: int = 0
    #: Least severe log level written: debug, info, warning or error.
    log_level: str = "info"
    #: Log format: text (one line per event, for a person), json (one object per line, for
    #: collectors) or auto (text when stderr is a terminal, else json).
    log_format: str = "auto"
    # == security ==
    #: TLS/mTLS on the planner's gRPC port (--tls-*); its metrics scrapes are plain HTTP as
    #: every service's metrics port is.
    tls: TlsConfig = field(default_factory=TlsConfig)

    def check(self) -> None:
        """Raises InvalidRequest naming the setting the planner cannot start without (the
        defaults are incomplete on purpose: there is no plan without pools)."""
        if not self.plan.pools:
            raise InvalidRequest("the planner needs pools to size: list them under `plan: "
                                 "pools:` in --config", param="plan.pools")
        if self.connector == "local" and not self.launcher_address:  # (others: their factory)
            raise InvalidRequest("the local connector needs --launcher-address (tandem up "
                                 "--planner passes it)", param="launcher_address")
        if not self.frontend_metrics_urls:
            raise InvalidRequest("the planner needs the frontend's metrics: "
                                 "--frontend-metrics-urls", param="frontend_metrics_urls")
        if not self.scrape_timeout_s > 0:
            raise InvalidRequest(f"scrape_timeout_s must be > 0, got {self.scrape_timeout_s}",
                                 param="scrape_timeout_s")


def load_models(plan: PlannerConfig) -> dict[str, PoolModel]:
    """Each pool's capacity model from its profile file. Raises InvalidRequest for a pool
    without a profile or with one that cannot size it, OSError for a file it cannot read."""
    models = {}
    for pool in plan.pools:
        if not pool.profile:
            raise InvalidRequest(f"planner pool '{pool.name}' needs a profile (what one worker "
                                 "carries within a target; tandem.planner.profile)",
                                 param=f"{pool.name}.profile")
        model = PoolModel(read_profile(pool.profile))
        check_model(pool, model)
        models[pool.name] = model
    return models
