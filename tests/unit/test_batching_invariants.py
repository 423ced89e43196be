"""The shared batching engine under churn: random arrivals, aborts mid-run, shared prefixes and
a pool too small for everything (preemption, eviction). After every step no block is owned
twice and every ref count equals the number of live tables holding it; at the end every block
is free. Driven step by step through the mock backend (no timing), so the check is exact."""
from __future__ import annotations

import random

from tandem.engines.args import EngineArgs
from tandem.engines.mock.engine import create_mock_engine
from tandem.engines.types import EngineRequest, SamplingParams


async def test_block_invariants_hold_after_every_step(tiny_model: str) -> None:
    engine = create_mock_engine(EngineArgs(model=tiny_model, kv_block_size=4, num_gpu_blocks=40,
                                           speedup_ratio=0, max_num_tokens=24))
    rng = random.Random(7)
    shared = [rng.randrange(10, 900) for _ in range(12)]  # 3 blocks several prompts share
    live: list[str] = []
    preempted_before = engine.scheduler.num_preemptions
    for step in range(400):
        if rng.random() < 0.3:
            rid = f"r{step}"
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(10, 900) for _ in range(rng.randrange(1, 20))]
            engine.add_request(EngineRequest(rid, tuple(prompt), SamplingParams(
                max_tokens=rng.randrange(1, 30), ignore_eos=True)))
            live.append(rid)
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        if engine.scheduler.has_work:
            await engine._step()
        tables = [req.table for req in engine._requests.values()]
        engine.pool.check_invariants(tables)
        live = [rid for rid in live if rid in engine._requests]
    while engine.scheduler.has_work:
        await engine._step()
        engine.pool.check_invariants([req.table for req in engine._requests.values()])
    assert engine.pool.num_used == 0
    assert engine.scheduler.num_preemptions > preempted_before  # the pool really was too small
