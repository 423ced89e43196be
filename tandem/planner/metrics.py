"""The planner's own Prometheus metrics: what it wants each pool to have and what each has, the
load it predicted, the decisions it took, and what went wrong (pages it could not read, scale
calls that failed). An HPA or KEDA can scale on `tandem_planner_desired_workers` instead of
letting the planner act (deploy/README.md). `tandem_planner_decisions` counts the interval
decisions; the fast scale-ups between them have their own counter."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.planner.decision import Decision
from tandem.planner.predictor import Load


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("tandem_planner_desired_workers", "Workers the planner's last "
                             "decision wants the pool to have", ("pool",), registry=r)
        self.actual = Gauge("tandem_planner_actual_workers", "Workers the pool has as the "
                            "connector counts them (starting in, draining out)", ("pool",),
                            registry=r)
        self.demand = Gauge("tandem_planner_demand_workers", "Fractional workers the predicted "
                            "load needs, before bounds, hysteresis and the GPU budget "
                            "(+Inf: the target is out of the profile's reach)", ("pool",),
                            registry=r)
        self.decisions = Counter("tandem_planner_decisions", "Decisions per pool, by change: "
                                 "up, down or none", ("pool", "change"), registry=r)
        self.fast_scale_ups = Counter("tandem_planner_fast_scale_ups", "Pools grown between "
                                      "intervals on the requests in flight or waiting (a "
                                      "backlog check)", ("pool",), registry=r)
        self.predicted_rate = Gauge("tandem_planner_predicted_request_rate", "Requests per "
                                    "second the planner predicts for the next interval",
                                    registry=r)
        self.predicted_isl = Gauge("tandem_planner_predicted_isl_tokens", "Mean prompt length "
                                   "predicted for the next interval, tokens", registry=r)
        self.predicted_osl = Gauge("tandem_planner_predicted_osl_tokens", "Mean output length "
                                   "predicted for the next interval, tokens", registry=r)
        self.gpus = Gauge("tandem_planner_target_gpus", "GPUs the targets hold together",
                          registry=r)
        self.scrape_failures = Counter("tandem_planner_scrape_failures", "Metrics pages that "
                                       "did not answer in a round", ("url",), registry=r)
        self.skipped = Counter("tandem_planner_skipped_intervals", "Intervals not decided on "
                               "(a frontend page missing, or no workers listed)", registry=r)
        self.scale_errors = Counter("tandem_planner_scale_errors", "Scale calls the connector "
                                    "refused or could not make", ("pool",), registry=r)

    def observe(self, decision: Decision, load: Load, actual: dict[str, int]) -> None:
        for pool in decision.pools:
            self.desired.labels(pool.pool).set(pool.target)
            self.demand.labels(pool.pool).set(pool.demand)
            if decision.fast:
                if pool.is_change:
                    self.fast_scale_ups.labels(pool.pool).inc()
                continue
            change = ("up" if pool.target > pool.previous else
                      "down" if pool.target < pool.previous else "none")
            self.decisions.labels(pool.pool, change).inc()
        self.set_actual(actual)
        self.predicted_rate.set(load.request_rate)
        self.predicted_isl.set(load.mean_isl)
        self.predicted_osl.set(load.mean_osl)
        self.gpus.set(decision.num_gpus)

    def set_actual(self, actual: dict[str, int]) -> None:
        for pool, workers in actual.items():
            self.actual.labels(pool).set(workers)
