"""What resizing a running topology asks of the parts around it: the supervisor restarts a worker
added later and never one retired on purpose; the router takes a re-read config's members (and
forgets the KV blocks of those gone)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

from tandem.engines.types import BlockStored
from tandem.launcher.supervisor import Supervisor
from tandem.routing.config import PoolConfig
from tandem.routing.membership import Membership
from tandem.routing.router import Router


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


async def _wait(predicate: object, timeout_s: float = 10.0) -> None:
    """Until `predicate()` holds: the supervisor's threads report exits on the loop."""
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


async def test_an_added_worker_is_restarted_and_a_retired_one_is_not() -> None:
    children = {"router": _sleeper()}
    restarted: list[str] = []

    def restart(name: str) -> subprocess.Popen[bytes]:
        restarted.append(name)
        children[name] = _sleeper()
        return children[name]

    supervisor = Supervisor(children, restart, "on-failure", None, {})
    supervisor.start()
    try:
        children["decode-1"] = _sleeper()
        supervisor.watch("decode-1")
        children["decode-1"].kill()  # a crash: restarted
        await _wait(lambda: restarted == ["decode-1"])
        assert supervisor.states["decode-1"].restarts == 1
        supervisor.retire("decode-1")
        assert supervisor.states["decode-1"].state == "draining"
        children["decode-1"].terminate()  # stopped on purpose: gone, not restarted
        await _wait(lambda: "decode-1" not in supervisor.states)
        assert restarted == ["decode-1"]
    finally:
        await supervisor.stop()
        for child in children.values():
            child.kill()
            child.wait()


async def test_the_router_takes_a_reread_configs_members() -> None:
    pools = [PoolConfig(name="decode", kind="decode", workers=["127.0.0.1:1", "127.0.0.1:2"],
                        policy="kv")]
    router = Router(pools, None, block_size=4, typical_osl=16)
    changes: list[int] = []
    membership = Membership(router, 10.0, lambda: changes.append(1))
    membership.start(pools)
    router.index.apply("127.0.0.1:2", [BlockStored((11, 12), None, tuple(range(8)), 4)])
    assert router.index.num_blocks_of("127.0.0.1:2") == 2
    try:
        await membership.take_static_members(
            [PoolConfig(name="decode", kind="decode", workers=["127.0.0.1:1", "127.0.0.1:3"],
                        policy="kv")])
        assert router.pool_members("decode") == ["127.0.0.1:1", "127.0.0.1:3"]
        assert sorted(membership.watchers) == ["127.0.0.1:1", "127.0.0.1:3"]
        assert router.index.num_blocks_of("127.0.0.1:2") == 0  # its blocks left the index
        assert changes  # the router service recounts its candidates
        # A change that needs a restart (another policy) leaves the members alone.
        await membership.take_static_members(
            [PoolConfig(name="decode", kind="decode", workers=[], policy="round_robin")])
        assert router.pool_members("decode") == ["127.0.0.1:1", "127.0.0.1:3"]
    finally:
        await membership.close()


async def test_two_pools_shrunk_at_once_both_leave() -> None:
    """Two updates at once (a frontend's local router spawns one per pool; a router may reload
    twice): each drops its own gone workers once, none fails on the other's."""
    pools = [PoolConfig(name=name, kind=name, policy="kv",
                        workers=[f"127.0.0.1:{port + i}" for i in range(3)])
             for name, port in (("prefill", 10), ("decode", 20))]
    router = Router(pools, None, block_size=4, typical_osl=16)
    membership = Membership(router, 10.0, lambda: None)
    membership.start(pools)
    try:
        await asyncio.gather(membership.set_members("prefill", ["127.0.0.1:10"]),
                             membership.set_members("decode", ["127.0.0.1:20"]))
        assert sorted(membership.watchers) == ["127.0.0.1:10", "127.0.0.1:20"]
        assert router.pool_members("prefill") == ["127.0.0.1:10"]
        assert router.pool_members("decode") == ["127.0.0.1:20"]
    finally:
        await membership.close()
