"""Python's cyclic garbage collector on a serving process.

A worker's heap after start-up holds a few hundred thousand objects that live as long as the
process (modules, the model's parameters and modules, the tokenizer, CUDA graphs' state): 341,000
in a process holding the demo model's reference engine on the CPU, where one full collection
took 186 ms on the 2-core development VM. The collector runs a full pass when enough new objects
have survived, at a moment nobody chooses: on a serving process that is a step or a batch of SSE
writes stalled for that long, now and then. So every service process, once started and before it
serves, collects once and moves what survived to the permanent generation (`gc.freeze`, as vLLM
and SGLang do after their warm-up): later passes scan only what was made since. Reference
counting frees as before; only cycles among start-up objects wait for the thaw at shutdown.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


#: A collector pass longer than this is logged (a stall every request in flight felt).
SLOW_PASS_S = 0.05


class PassTimer:
    """Times the collector's passes (gc.callbacks) and logs a warning for each slow one, with
    its generation and how many objects it collected."""

    def __init__(self, threshold_s: float = SLOW_PASS_S) -> None:
        self.threshold_s = threshold_s
        self._started = 0.0
        #: Slow passes so far.
        self.num_slow = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        if seconds >= self.threshold_s:
            self.num_slow += 1
            log.warning("slow garbage-collector pass", extra={
                "generation": info.get("generation"), "ms": round(1000 * seconds, 1),
                "collected": info.get("collected")})


def freeze_startup_heap() -> int:
    """Collects, then freezes every object left, and from then on logs slow passes
    (`PassTimer`); returns how many objects are frozen."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    if not any(isinstance(c, PassTimer) for c in gc.callbacks):
        gc.callbacks.append(PassTimer())
    frozen = gc.get_freeze_count()
    log.debug("start-up heap frozen for the garbage collector", extra={
        "objects": frozen, "ms": round(1000 * (time.perf_counter() - started), 1)})
    return frozen


def thaw() -> None:
    """Undoes the freeze at shutdown, so that the interpreter's last collection frees start-up
    cycles as it would have (extension modules such as Triton's report what was never freed
    at exit). That collection is long and harms nobody: slow passes are no longer logged."""
    gc.callbacks[:] = [c for c in gc.callbacks if not isinstance(c, PassTimer)]
    gc.unfreeze()
