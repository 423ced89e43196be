"""`tandem_build_info{version, service} 1`: which Tandem each service runs, on its /metrics."""
from __future__ import annotations

import importlib.metadata

from prometheus_client import CollectorRegistry, Gauge


def register(registry: CollectorRegistry, service: str) -> None:
    """Adds the build info gauge for `service` (frontend, router, prefill, decode, encode)."""
    gauge = Gauge("tandem_build_info", "Always 1; the labels say which Tandem this is",
                  ("version", "service"), registry=registry)
    gauge.labels(importlib.metadata.version("tandem"), service).set(1)
