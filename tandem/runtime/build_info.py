"""`tandem_build_info{version, service} 1`: which Tandem each service runs, on its /metrics."""
from __future__ import annotations

import importlib.metadata

from prometheus_client import CollectorRegistry, Gauge


def register(registry: CollectorRegistry, service: str) -> None:
    """Adds the build info gauge for `service` (frontend, router, prefill, decode, encode)."""
    gauge = Gauge("tandem_build_info", "Always 1; the labels say which Tandem this is",
                  ("version", "service"), registry=registry)
    gauge.labels(version(), service).set(1)


def version() -> str:
    """Tandem's installed version; "(not installed)" when run from a source checkout."""
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"
