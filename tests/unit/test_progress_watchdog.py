"""The progress watchdog: stuck engines turn unhealthy, idle ones never do, recovery turns them
back; a draining worker's health is left to shutdown."""
from __future__ import annotations

import asyncio

import pytest

from tandem.engines.args import EngineArgs
from tandem.engines.base import Progress
from tandem.engines.mock.engine import create_mock_engine
from tandem.engines.types import EngineRequest, SamplingParams
from tandem.errors import Unavailable
from tandem.runtime.progress import ProgressWatchdog, WatchdogConfig


class FakeEngine:
    name = "fake"

    def __init__(self) -> None:
        self.state = Progress(False, 0)
        self.canary_error: Exception | None = None
        self.num_canaries = 0

    def progress(self) -> Progress:
        return self.state

    async def health_canary(self, timeout_s: float) -> None:
        self.num_canaries += 1
        if self.canary_error is not None:
            raise self.canary_error


def _watchdog(engine: FakeEngine, config: WatchdogConfig, allowed: list[bool] | None = None
              ) -> tuple[ProgressWatchdog, list[bool]]:
    published: list[bool] = []

    async def set_serving(serving: bool) -> None:
        published.append(serving)

    return ProgressWatchdog(engine, config, set_serving,  # type: ignore[arg-type]
                            lambda: allowed is None or allowed[0]), published


def test_stall_with_work_turns_unhealthy_and_steps_recover() -> None:
    engine = FakeEngine()
    dog, published = _watchdog(engine, WatchdogConfig(progress_timeout_s=2))

    async def run() -> None:
        assert await dog.check(0.0)
        engine.state = Progress(True, 5)
        assert await dog.check(1.0)       # work arrived; the clock starts now
        assert await dog.check(2.5)       # 1.5 s without a step: not yet
        assert not await dog.check(3.1)   # 2.1 s: stuck
        assert not await dog.check(10.0)  # published once
        engine.state = Progress(True, 6)
        assert await dog.check(10.1)

    asyncio.run(run())
    assert published == [False, True]
    assert dog.reason == ""


def test_idle_engine_is_never_stuck() -> None:
    engine = FakeEngine()
    dog, published = _watchdog(engine, WatchdogConfig(progress_timeout_s=1))

    async def run() -> None:
        for t in range(100):
            assert await dog.check(float(t))

    asyncio.run(run())
    assert published == []


def test_draining_worker_health_is_not_touched() -> None:
    engine = FakeEngine()
    allowed = [True]
    dog, published = _watchdog(engine, WatchdogConfig(progress_timeout_s=1), allowed)

    async def run() -> None:
        engine.state = Progress(True, 1)
        await dog.check(0.0)
        allowed[0] = False
        await dog.check(5.0)

    asyncio.run(run())
    assert published == []


def test_failed_canary_turns_unhealthy_until_one_succeeds() -> None:
    engine = FakeEngine()
    dog, published = _watchdog(engine, WatchdogConfig(progress_timeout_s=0, canary_interval_s=1))

    async def run() -> None:
        assert await dog.check(1.0)
        engine.canary_error = Unavailable("no token")
        assert await dog.check(1.5)       # not due yet
        assert not await dog.check(2.0)
        engine.canary_error = None
        assert await dog.check(3.0)

    asyncio.run(run())
    assert published == [False, True]
    assert engine.num_canaries == 3


def test_engine_without_canary_relies_on_progress(tiny_model: str) -> None:
    async def run() -> None:
        engine = create_mock_engine(EngineArgs(model=tiny_model, speedup_ratio=0,
                                               num_gpu_blocks=64, kv_block_size=4))
        await engine.start()
        dog = ProgressWatchdog(engine, WatchdogConfig(progress_timeout_s=1, canary_interval_s=1),
                               lambda serving: asyncio.sleep(0))
        assert await dog.check(5.0)  # Unimplemented canary: not a failure
        await engine.close()

    asyncio.run(run())


@pytest.mark.parametrize("paused", [False, True])
def test_batching_engine_progress_and_pause_hook(tiny_model: str, paused: bool) -> None:
    async def run() -> None:
        engine = create_mock_engine(EngineArgs(model=tiny_model, speedup_ratio=0,
                                               num_gpu_blocks=64, kv_block_size=4))
        await engine.start()
        assert engine.progress() == Progress(False, 0)
        if paused:
            engine.pause_steps()
        stream = engine.add_request(EngineRequest("r1", (1, 2, 3), SamplingParams(max_tokens=3, ignore_eos=True)))
        for _ in range(10):
            await asyncio.sleep(0)
        progress = engine.progress()
        if paused:
            assert progress == Progress(True, 0)
            engine.resume_steps()
        chunks = [c async for c in stream]
        assert sum(len(c.token_ids) for c in chunks) == 3
        assert not engine.progress().has_work and engine.progress().num_steps >= 3
        await engine.close()

    asyncio.run(run())


def test_close_ends_a_paused_engine(tiny_model: str) -> None:
    async def run() -> None:
        engine = create_mock_engine(EngineArgs(model=tiny_model, speedup_ratio=0,
                                               num_gpu_blocks=64, kv_block_size=4))
        await engine.start()
        engine.pause_steps()
        engine.add_request(EngineRequest("r1", (1, 2, 3), SamplingParams(max_tokens=3, ignore_eos=True)))
        await asyncio.wait_for(engine.close(), 5)

    asyncio.run(run())
