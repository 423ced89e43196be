"""The soak script, briefly: mixed traffic with abandoned streams and bad requests gets only the
answers it deserves, and afterwards every worker's free KV blocks and every process's memory
are back where they started (memory within a margin: allocators keep some)."""
from __future__ import annotations

from benchmarks.soak import EXPECTED, soak
from tests.e2e.topology import start_topology

#: Resident memory a process may grow by over the run, bytes: far below what a leak of the
#: traffic's requests (thousands) would cost, above allocator and cache noise.
RSS_MARGIN = 48 * 1024 * 1024


def test_short_soak_leaks_nothing() -> None:
    topo = start_topology("--engine", "mock", "--frontend-max-inflight-requests", "8",
                          "--frontend-max-queued-requests", "4", num_decode=2)
    try:
        report = soak(topo.http_url, topo.model, topo.process.pid, topo.decode_addresses,
                      duration_s=15, num_clients=12, warmup_s=3)
        print(report.render())
        assert not report.errors
        kinds = {kind for kind, status in report.outcomes if status == 200 or kind == "bad"}
        assert kinds == set(EXPECTED)
        assert report.end.free_blocks == report.start.free_blocks
        assert all(free > 0 for free in report.start.free_blocks.values())
        growth = report.rss_growth()
        assert growth and all(g < RSS_MARGIN for g in growth.values()), growth
    finally:
        assert topo.stop() == 0
