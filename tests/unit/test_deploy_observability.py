"""The observability half of compose.yaml: the Grafana dashboard plots metrics the services
really expose, and Prometheus scrapes the ports the services really serve metrics on."""
from __future__ import annotations

import dataclasses
import json
import re

import yaml
from test_compose import ROOT, WORKER_STAGES, by_profile, load_compose, parsed_services

from tandem.engines.types import EngineStats
from tandem.frontend.metrics import FrontendMetrics
from tandem.routing.metrics import RouterMetrics
from tandem.runtime.worker_metrics import WorkerMetrics


def _zero_stats() -> EngineStats:
    """Engine stats with every required field 0, whatever fields EngineStats has."""
    return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)
                          if f.default is dataclasses.MISSING})


def _metric_names() -> set[str]:
    """Sample names the frontend, router and worker registries expose (counters as *_total,
    histograms as *_bucket/_sum/_count), without observing anything."""
    router = RouterMetrics()
    router.watch_index(dict)
    workers = WorkerMetrics("w", _zero_stats, "decode").registry
    names = set()
    for registry in (FrontendMetrics("m").registry, router.registry, workers):
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            names |= {family.name + s for s in suffixes.get(family.type, [""])}
    return names


def test_dashboard_plots_metrics_that_exist() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tandem.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\btandem_[a-z_]+", e)}
    known = _metric_names()
    assert {"tandem_frontend_time_to_first_token_seconds_bucket",
            "tandem_worker_kv_blocks_used", "tandem_kv_transfer_bytes_total"} <= known
    assert used - known == set()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("time to first token", "inter-token latency", "throughput", "kv cache usage",
                  "routing decisions"):
        assert topic in titles
    assert len(used) >= 15


def test_prometheus_scrapes_the_metrics_ports() -> None:
    compose = load_compose()
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j["dns_sd_configs"][0] for j in prometheus["scrape_configs"]}
    gpu = by_profile(compose, "gpu")
    assert gpu["frontend"][1].metrics_port
    assert jobs["tandem-frontend"] == {"names": ["frontend"], "type": "A",
                                       "port": gpu["frontend"][1].metrics_port}
    router = gpu["router"][1]
    assert router.metrics_port and jobs["tandem-router"]["port"] == router.metrics_port
    assert jobs["tandem-router"]["names"] == ["router"]
    assert set(jobs["tandem-workers"]["names"]) == WORKER_STAGES
    worker_ports = {config.metrics_port for stage, config in parsed_services(compose).values()
                    if stage in WORKER_STAGES}
    assert worker_ports == {jobs["tandem-workers"]["port"]}
