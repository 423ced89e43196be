"""The planner's core: pools sized to their SLA targets from a capacity profile and live metrics.

Pure and CPU-only: `config` (targets per pool, GPU budget, hysteresis), `profile` (what one
worker can carry within a target, and the online correction), `predictor` (the next interval's
load), `demand` (workers a load needs), `decision` (worker counts per pool within bounds,
hysteresis and the budget, with the reason), `exposition` and `observe` (Prometheus text to
per-interval observations).
On top, the service (`tandem serve planner`, services/planner): `loop` (every interval:
`scrape` -> observe -> refine -> predict -> decide -> act, with `removal` naming the workers to
remove first), `connector` (the interface it acts through: `local` for `tandem up`, `k8s` for
Kubernetes), `metrics` and `report` (what it exposes), `service_config` (its typed config).
"""
