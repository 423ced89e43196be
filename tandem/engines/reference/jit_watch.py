"""Triton kernels compiled after the engine is ready, logged (issue 25, item 4: kernel tuning and
compilation belong before SERVING, never on a user's request).

Triton compiles a kernel per specialization of its arguments (dtypes, constexprs, which integer
arguments are 1 or divisible by 16) the first time a launch needs it. A variant that no warm-up
step or graph capture met is compiled on the step that first needs it: ~100-400 ms on the H100
host, or a few ms when Triton's disk cache has it from an earlier process, paid by every request
in that step. `watch()` has Triton call back around each compilation (Triton 3.5+: its
`jit_cache_hook` and `jit_post_compile_hook`) and logs a warning for each one, with the kernel,
its specialization and how long it took. Each is a warm-up step or a `do_not_specialize` to add.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_started: dict[str, float] = {}
#: Kernels compiled since `watch()`: (kernel name, milliseconds).
compiled: list[tuple[str, float]] = []


def watch() -> bool:
    """From now on, logs each Triton compilation in this process. False where Triton has no
    compile hooks (no Triton, or older than 3.5); calling it again changes nothing."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = knobs.runtime
    if getattr(runtime, "jit_post_compile_hook", None) is _after:
        return True
    if runtime.jit_cache_hook is not None or runtime.jit_post_compile_hook is not None:
        return False  # somebody else's hooks: leave them
    runtime.jit_cache_hook = _before
    runtime.jit_post_compile_hook = _after
    return True


def _before(**kwargs: Any) -> bool:
    with _lock:
        _started[str(kwargs.get("key"))] = time.perf_counter()
    return False  # compile as usual


def _after(**kwargs: Any) -> None:
    with _lock:
        started = _started.pop(str(kwargs.get("key")), None)
    ms = 1000 * (time.perf_counter() - started) if started is not None else float("nan")
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or str(fn)
    compiled.append((name, ms))
    log.warning("Triton kernel compiled while serving", extra={
        "kernel": name, "ms": round(ms, 1), "variant": str(kwargs.get("repr", ""))[:2000]})
