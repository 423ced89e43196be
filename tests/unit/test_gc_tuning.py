"""A service process freezes its start-up heap for the garbage collector before it serves, and
logs the collector's slow passes."""
from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap

import pytest

from tandem.runtime.gc_tuning import PassTimer

SCRIPT = textwrap.dedent("""
    import asyncio, gc
    from tandem.runtime.server import GrpcService, ServerOptions

    async def main():
        service = GrpcService(ServerOptions(port=0, grace_s=0.1), service_names=[])
        before = gc.get_freeze_count()

        async def report():  # once started
            print(before, gc.get_freeze_count(), flush=True)
            service.request_stop()

        service.on_start(report)
        await service.run()
        print(gc.get_freeze_count(), len(gc.callbacks), flush=True)  # thawed at the end

    asyncio.run(main())
""")


def test_a_service_freezes_its_start_up_heap_while_it_runs() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    before, during, after, callbacks = map(int, out.stdout.split())
    assert before == 0 and during > 10_000  # every module and object made until then
    assert after == 0 and callbacks == 0  # thawed, slow passes no longer logged


def test_a_slow_collector_pass_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    timer = PassTimer(threshold_s=0.0)  # every pass counts as slow
    gc.callbacks.append(timer)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.runtime.gc_tuning"):
            gc.collect(0)
    finally:
        gc.callbacks.remove(timer)
    assert timer.num_slow == 1
    assert [r.generation for r in caplog.records] == [0]  # type: ignore[attr-defined]
