"""The planner's core: pools sized to their SLA targets from a capacity profile and live metrics.

Pure and CPU-only: `config` (targets per pool, GPU budget, hysteresis), `profile` (what one
worker can carry within a target, and the online correction), `predictor` (the next interval's
load), `demand` (workers a load needs), `decision` (worker counts per pool within bounds,
hysteresis and the budget, with the reason), `exposition` and `observe` (Prometheus text to
per-interval observations).
The service that runs them on a timer and the connectors that act are built on top.
"""
