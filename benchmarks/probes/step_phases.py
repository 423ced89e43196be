"""Where a decode step launched ahead spends its time, on the host and on the device (issue 25).

`StepPhases(engine).install()` wraps the reference engine's launch path (the steps' thread of
tandem.engines.reference.overlap) and its step loop, and records per launched step:

- on the device, CUDA events (timed against each other, on the device's clock): the launch's
  start (before the input ids' copy), the logits queued, the grammar mask about to be applied
  (guided steps), the sampling queued. From them: the forward pass, the wait for the mask, the
  sampling, and the gap before the next step's launch start (the device idle, waiting for the
  host to queue it; ~0 when the host runs ahead);
- on the steps' thread (host): the whole launch, queuing the draws' noise (guided steps), the
  mask's work there (`constrain`: on CUDA queuing the wait on the host flag, the mask's copy
  and application; on the CPU also the wait for the previous step's tokens, the grammars'
  deferred accepts and the mask fill);
- on the mask thread (CUDA): the whole fill (`mask thread`: the wait for the previous step's
  tokens, the accepts and the fill), of which the accepts and the fill;
- on the event loop: scheduling, building the inputs and queuing the launch, waiting for the
  step settled, applying its tokens (emit to the streams), and the rest of the loop per step.

A guided step's mask is ready once the previous step's event fired and the mask thread's accepts
and fill are done, while the device runs this step's forward pass. The device waits for the
mask when that host path is longer than the forward pass ("mask wait"), and for the next launch
when the loop and the steps' thread together take longer than the step ("launch gap").

Used by benchmarks/guided_decoding.py --phases. Wrapping costs ~10 us per phase on the host.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.engines.reference import overlap


class _HostEvent:
    """Stands in for a CUDA event on the CPU, where the launch computes the step: host time."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, later: _HostEvent) -> float:
        return 1000 * (later.at - self.at)


def _event() -> Any:
    if not torch.cuda.is_available():
        return _HostEvent()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _Launch:
    """One launch on the steps' thread: host seconds per phase and device events."""

    __slots__ = ("host", "events", "rows", "guided")

    def __init__(self, rows: int) -> None:
        self.host: dict[str, float] = {}
        self.events: dict[str, Any] = {}
        self.rows = rows
        self.guided = False


class StepPhases:
    """Per-step phase timings of one engine; `reset` between rounds, `summary` after a round
    (synchronizes the device). On the CPU the "device" columns are host time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.launches: list[_Launch] = []
        self.loop: list[dict[str, float]] = []
        self._current: _Launch | None = None
        #: The launch whose mask the mask thread fills, and each launch by its step.
        self._mask_current: _Launch | None = None
        self._by_step: dict[int, _Launch] = {}
        self._loop_step: dict[str, float] = {}

    def reset(self) -> None:
        self.launches, self.loop, self._by_step = [], [], {}

    # ---- wrapping ---------------------------------------------------------------------------

    def install(self) -> None:
        engine, steps = self.engine, self.engine.overlap
        assert steps is not None, "--phases needs the overlap scheduler"
        tracer = self

        def timed_host(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    launch = tracer._launch_of_thread()
                    if launch is not None:
                        launch.host[name] = launch.host.get(name, 0.0) + (
                            time.perf_counter() - start)
            return wrapper

        launch_fn, decode_logits, sampler_launch = steps._launch, steps.decode_logits, \
            steps.sampler.launch

        def traced_launch(step: Any, inputs: Any, samples: Any, guides: Any, previous: Any,
                          rows: Any) -> None:
            record = _Launch(len(samples))
            record.guided = guides is not None
            tracer._current = record
            tracer.launches.append(record)  # before the launch ends: the loop may settle it
            tracer._by_step[id(step)] = record
            record.events["start"] = _event()
            start = time.perf_counter()
            launch_fn(step, inputs, samples, guides, previous, rows)
            record.host["launch"] = time.perf_counter() - start
            tracer._current = None

        def traced_logits(inputs: Any) -> torch.Tensor:
            logits = decode_logits(inputs)
            if tracer._current is not None:
                tracer._current.events["logits"] = _event()
            return logits

        def traced_sampler_launch(logits: Any, samples: Any, noise: Any = None) -> Any:
            draws = sampler_launch(logits, samples, noise)
            if tracer._current is not None and threading.current_thread().name.startswith(
                    "tandem-steps"):
                tracer._current.events["sampled"] = _event()
            return draws

        apply_bitmask = overlap.apply_bitmask

        def traced_apply(logits: Any, bitmask: Any) -> None:
            if tracer._current is not None:
                tracer._current.events["mask"] = _event()
            apply_bitmask(logits, bitmask)

        steps._launch = traced_launch
        steps.decode_logits = traced_logits
        steps.sampler.launch = traced_sampler_launch
        overlap._constrain = timed_host("constrain", overlap._constrain)
        steps.sampler.noise = timed_host("noise", steps.sampler.noise)
        if steps.masks is not None:
            masks, fill = steps.masks, steps.masks._fill
            masks.queue = timed_host("constrain", masks.queue)

            def traced_fill(step: Any, *args: Any) -> None:
                tracer._mask_current = tracer._by_step.pop(id(step), None)
                timed_host("mask_thread", fill)(step, *args)
                tracer._mask_current = None

            masks._fill = traced_fill
        overlap.fill_bitmask = timed_host("fill", overlap.fill_bitmask)
        overlap.apply_bitmask = timed_host("apply", traced_apply)

        self._wrap_loop(engine)

    def _launch_of_thread(self) -> _Launch | None:
        """The launch the calling thread works on: the steps' thread's, the mask thread's."""
        name = threading.current_thread().name
        if name.startswith("tandem-steps"):
            return self._current
        if name.startswith("tandem-masks"):
            return self._mask_current
        return None

    def _wrap_loop(self, engine: Any) -> None:
        tracer = self
        step_fn, settle, launch, schedule = (engine._step, engine._settle, engine._launch,
                                            engine.scheduler.schedule)
        sampled = overlap.LaunchedStep.sampled

        def add(name: str, seconds: float) -> None:
            tracer._loop_step[name] = tracer._loop_step.get(name, 0.0) + seconds

        async def traced_step() -> Any:
            tracer._loop_step = {}
            start = time.perf_counter()
            plan = await step_fn()
            tracer._loop_step["step"] = time.perf_counter() - start
            tracer.loop.append(tracer._loop_step)
            return plan

        async def traced_settle() -> None:
            start = time.perf_counter()
            await settle()
            add("settle", time.perf_counter() - start)

        async def traced_sampled(step: Any) -> Any:
            start = time.perf_counter()
            out = await sampled(step)
            add("wait", time.perf_counter() - start)
            return out

        def traced_launch(plan: Any, after: Any) -> Any:
            start = time.perf_counter()
            out = launch(plan, after)
            add("launch", time.perf_counter() - start)
            return out

        def traced_schedule() -> Any:
            start = time.perf_counter()
            out = schedule()
            add("schedule", time.perf_counter() - start)
            return out

        engine._step, engine._settle, engine._launch = traced_step, traced_settle, traced_launch
        engine.scheduler.schedule = traced_schedule
        overlap.LaunchedStep.sampled = traced_sampled  # type: ignore[method-assign]

    # ---- figures ----------------------------------------------------------------------------

    def summary(self) -> dict[str, float]:
        """Medians in ms over the round's launched steps (those with all their events) and over
        the loop's steps; `launched`, `loop_steps`: counts."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        med = statistics.median
        out: dict[str, float] = {}
        launches = [r for r in self.launches
                    if "logits" in r.events and "sampled" in r.events and "launch" in r.host]
        if launches:
            device: dict[str, list[float]] = {"fwd": [], "mask_wait": [], "sample": [],
                                              "launch_gap": []}
            for record, following in zip(launches, launches[1:] + [None]):
                ev = record.events
                device["fwd"].append(ev["start"].elapsed_time(ev["logits"]))
                if "mask" in ev:
                    device["mask_wait"].append(ev["logits"].elapsed_time(ev["mask"]))
                    device["sample"].append(ev["mask"].elapsed_time(ev["sampled"]))
                else:
                    device["sample"].append(ev["logits"].elapsed_time(ev["sampled"]))
                if following is not None:
                    device["launch_gap"].append(
                        ev["sampled"].elapsed_time(following.events["start"]))
            for name, values in device.items():
                if values:
                    out[f"gpu_{name}"] = med(values)
            for name in ("launch", "noise", "constrain", "mask_thread", "fill", "apply"):
                values = [1000 * r.host[name] for r in launches if name in r.host]
                if values:
                    out[f"thread_{name}"] = med(values)
            out["launched"] = len(launches)
        steps = [s for s in self.loop if "step" in s]
        if steps:
            for name in ("step", "schedule", "launch", "settle", "wait"):
                out[f"loop_{name}"] = med(1000 * s.get(name, 0.0) for s in steps)
            out["loop_emit"] = med(1000 * (s.get("settle", 0.0) - s.get("wait", 0.0))
                                   for s in steps)
            out["loop_steps"] = len(steps)
        return out


#: Columns of the phases table: (summary key, header).
COLUMNS = [("gpu_fwd", "GPU fwd"), ("gpu_mask_wait", "GPU mask wait"), ("gpu_sample", "GPU sample"),
           ("gpu_launch_gap", "GPU launch gap"), ("thread_launch", "thread launch"),
           ("thread_noise", "thread noise"), ("thread_constrain", "thread constrain"),
           ("thread_mask_thread", "mask thread"), ("thread_fill", "accepts+fill"),
           ("thread_apply", "thread apply"),
           ("loop_step", "loop step"), ("loop_schedule", "loop schedule"),
           ("loop_launch", "loop launch"), ("loop_wait", "loop wait"), ("loop_emit", "loop emit")]


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    """A markdown table, ms medians per step, one row per (label, summary)."""
    lines = ["| run | " + " | ".join(h for _, h in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for label, summary in rows:
        cells = [f"{summary[k]:.2f}" if k in summary else "" for k, _ in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
