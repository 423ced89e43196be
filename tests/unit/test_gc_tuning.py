"""A service process freezes its start-up heap for the garbage collector before it serves."""
from __future__ import annotations

import subprocess
import sys
import textwrap

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

    asyncio.run(main())
""")


def test_a_service_freezes_its_start_up_heap_when_it_runs() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert before == 0 and after > 10_000  # every module and object made until then
