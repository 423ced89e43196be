from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.topology import Topology, start_topology


@pytest.fixture(scope="session")
def fuzz_topology() -> Iterator[Topology]:
    """frontend -> router -> prefill and decode workers (mock engine, no delay), shared by the
    gRPC and HTTP fuzzers."""
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", num_prefill=1)
    yield topo
    assert topo.stop() == 0
