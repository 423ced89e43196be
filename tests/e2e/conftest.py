from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.topology import Topology, start_topology


@pytest.fixture(scope="session")
def topology() -> Iterator[Topology]:
    """frontend -> router -> two decode workers (mock engine, no delay), started by `tandem up`."""
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0", num_decode=2)
    yield topo
    assert topo.stop() == 0


@pytest.fixture(scope="session")
def slow_topology() -> Iterator[Topology]:
    """The same topology with the mock engine's timing model on, five times slower than real
    time (~30 ms per decode step), so that a long answer cannot finish inside a test's wait."""
    topo = start_topology("--engine", "mock", "--speedup-ratio", "0.2", num_decode=1)
    yield topo
    assert topo.stop() == 0
