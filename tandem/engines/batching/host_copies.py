"""The host KV tier's side of the step loop: each step's offload and onboard copies run after
`schedule()` and before anything writes the step's blocks (KV reads, the forward pass), and
their counters.

A request never waits on a copy that cannot finish: a full host tier drops its oldest blocks
(tandem.kv.host_tier), and a copy that fails forgets every block it touched in both tiers and
sends the requests that needed the onboarded blocks back to recompute them.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tandem.engines.batching.scheduler import Scheduler, StepPlan
from tandem.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from tandem.kv.host_tier import BlockCopies

log = logging.getLogger(__name__)

#: ("offload" | "onboard", blocks, seconds) of copies known to have finished.
CopyTiming = tuple[str, int, float]
#: Runs a step's copies (the engine's `_copy_blocks`): (copies, sync) -> their timings, where
#: sync says a KV read follows that must not see a block an offload still reads.
CopyBlocks = Callable[["BlockCopies", bool], Awaitable[list[CopyTiming]]]


class HostCopies:
    """Runs the pool's queued copies through `copy_blocks` and counts them; a failed copy's
    requests go back to `scheduler` to recompute."""

    def __init__(self, pool: BlockPool, scheduler: Scheduler, block_bytes: int,
                 copy_blocks: CopyBlocks) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.copy_blocks = copy_blocks
        self.block_bytes = block_bytes
        self.num_offload_blocks = 0
        self.num_onboard_blocks = 0
        self.offload_seconds = 0.0
        self.onboard_seconds = 0.0
        self.num_failed = 0
        #: True while a step's copies run (tests: an abort or a kill lands in this window).
        self.is_copying = False

    async def run(self, plan: StepPlan) -> None:
        """Runs this step's copies; afterwards `plan` holds only requests still alive."""
        pool = self.pool
        copies = pool.take_copies()
        if not copies:
            return
        host = pool.host
        assert host is not None
        self.num_offload_blocks += len(copies.offloads)
        self.num_onboard_blocks += len(copies.onboards)
        self.is_copying = True
        try:
            # A KV read starting after this writes blocks an offload may still be reading.
            self.record(await self.copy_blocks(copies, bool(plan.loads)))
        except Exception:
            log.exception("copying KV blocks between the device pool and the host tier failed; "
                          "the requests that needed them recompute")
            self.num_failed += 1
            self._failed(copies, plan)
        finally:
            self.is_copying = False
            for slot, _ in copies.onboards:
                host.unpin(slot)
        # Requests aborted while the copies ran hold no blocks any more: not part of the step.
        if any(r.is_finished for r, _ in plan.scheduled):
            plan.scheduled = [(r, n) for r, n in plan.scheduled if not r.is_finished]
            plan.ready = [r for r in plan.ready if not r.is_finished]

    def record(self, timings: list[CopyTiming]) -> None:
        for kind, _blocks, seconds in timings:
            if kind == "offload":
                self.offload_seconds += seconds
            else:
                self.onboard_seconds += seconds

    def _failed(self, copies: BlockCopies, plan: StepPlan) -> None:
        pool, host = self.pool, self.pool.host
        assert host is not None
        for _, slot in copies.offloads:
            host.forget(slot)
        for slot, _ in copies.onboards:
            host.forget(slot)
        targets = {block for _, block in copies.onboards}
        pool.forget_blocks(sorted(targets))
        needing = {r for r, _ in plan.scheduled
                   if not r.is_finished and targets.intersection(r.table.block_ids)}
        self.scheduler.requeue(needing, plan)

    def stats_fields(self) -> dict[str, int | float]:
        """The host tier's EngineStats fields."""
        host = self.pool.host
        if host is None:
            return {}
        return {
            "kv_host_blocks_used": host.num_used,
            "kv_host_blocks_total": host.total,
            "kv_offload_blocks": self.num_offload_blocks,
            "kv_offload_bytes": self.num_offload_blocks * self.block_bytes,
            "kv_offload_seconds": self.offload_seconds,
            "kv_onboard_blocks": self.num_onboard_blocks,
            "kv_onboard_bytes": self.num_onboard_blocks * self.block_bytes,
            "kv_onboard_seconds": self.onboard_seconds,
            "kv_host_hit_rate": self.pool.host_hit_rate,
        }
