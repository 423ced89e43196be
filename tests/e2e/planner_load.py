"""What the planner's end-to-end tests drive and watch: a `tandem up --planner` topology on the
mock engine at speedup 1 with a short interval, a steady open-loop load of streamed completions
through the official `openai` client, and the planner's and launcher's views of the pools."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import pathlib
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import openai
import yaml

from tandem.launcher.supervisor import read_state, state_path
from tandem.planner.report import read_report
from tandem.routing.snapshot import PoolSnapshot
from tandem.runtime.router_status import RouterStatusClient
from tests.e2e.topology import Topology, start_topology

T = TypeVar("T")
INTERVAL_S = 2.0
#: One worker of this profile decodes 2 streams within the 20-ms ITL target (1 stream at 5 ms,
#: 10 at 140 ms, linear between), and prefill costs nothing; so a load of R requests per second
#: of OSL tokens needs R x OSL x 0.020 / 2 workers (Little's law at the target ITL). Few
#: streams per worker keep the tokens the tests stream, and so their CPU, low.
PROFILE = {"version": 1, "engine": "mock", "model": "test", "gpus_per_worker": 1,
           "prefill": [{"isl": 1, "tokens_per_s": 1e6, "ttft_ms": 1}],
           "decode": [{"context_length": 1, "batch_size": 1, "itl_ms": 5},
                      {"context_length": 1, "batch_size": 10, "itl_ms": 140}]}


def demand(rate: float, osl: int) -> float:
    """Workers PROFILE says a load needs (the planner's demand before rounding)."""
    return rate * osl * 0.020 / 2


def start_planned(tmp: pathlib.Path, max_workers: int, gpu_budget: int = 0,
                  restart: bool = False, hysteresis: dict[str, Any] | None = None) -> Topology:
    """One aggregated decode pool of 1 worker, sized by the planner every INTERVAL_S."""
    (tmp / "profile.json").write_text(json.dumps(PROFILE))
    plan = {"interval_s": INTERVAL_S, "gpu_budget": gpu_budget, "correction_alpha": 0,
            "hysteresis": hysteresis or {},
            "pools": [{"name": "decode", "role": "agg", "ttft_target_ms": 1000,
                       "itl_target_ms": 20, "min_workers": 1, "max_workers": max_workers,
                       "profile": str(tmp / "profile.json")}]}
    (tmp / "plan.yaml").write_text(yaml.safe_dump(plan))
    # A removed worker's streams (test_planner's 4000 tokens, ~25 s at the mock's ~6 ms a
    # step: past the demo model's 2,048 positions, hence --max-seq-len) finish well within
    # its grace period, even on a busy runner.
    # One frontend process: its OpenAI port's /metrics is then the whole frontend's.
    return start_topology("--engine", "mock", "--speedup-ratio", "1", "--planner",
                          "--planner-config", str(tmp / "plan.yaml"), "--grace-period-s", "90",
                          "--max-seq-len", "8192",
                          "--frontend-processes", "1", "--log-format", "json",
                          restart=restart, log=up_log(tmp))


def up_log(tmp: pathlib.Path) -> pathlib.Path:
    """The log of every service of start_planned's topology (JSON lines)."""
    return tmp / "tandem-up.log"


def drains(tmp: pathlib.Path) -> dict[int, int]:
    """Port -> the requests in flight on it when it began to drain, for every server of
    start_planned's topology that began a drain so far (tandem.runtime.server's "draining"
    line: its own record, made as the drain begins)."""
    found: dict[int, int] = {}
    for line in up_log(tmp).read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # not a service's log line (a traceback's, a warning of Python's)
        if isinstance(entry, dict) and entry.get("msg") == "draining":
            found[int(entry["address"].rpartition(":")[2])] = int(entry["in_flight"])
    return found


@dataclasses.dataclass
class Outcome:
    tokens: int = 0
    finish_reason: str | None = None
    error: str = ""


def client_of(topo: Topology) -> openai.OpenAI:
    """One client for many requests (thread-safe; making one per request costs CPU the
    topology under test needs)."""
    return openai.OpenAI(base_url=topo.http_url + "/v1", api_key="unused", max_retries=0)


def stream_completion(topo: Topology, max_tokens: int,
                      first_token: threading.Event | None = None,
                      client: openai.OpenAI | None = None) -> Outcome:
    """One streamed completion to its end (the mock ignores EOS here: exactly max_tokens)."""
    client = client or client_of(topo)
    out = Outcome()
    try:
        for chunk in client.completions.create(
                model=topo.model, prompt="Hello there", max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].finish_reason:
                out.finish_reason = chunk.choices[0].finish_reason
            if chunk.choices and first_token is not None:
                first_token.set()
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
    except openai.OpenAIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


class SteadyLoad:
    """Starts streamed completions at `rate` per second (open loop: the rate the planner
    measures is the rate sent, however fast the system answers), until `stop`. With `swing`,
    the rate swings by that much either way, as a sine of period `swing_period_s`: a steady
    load's noise, slow enough for the planner's intervals to see it."""

    def __init__(self, topo: Topology, rate: float, max_tokens: int, swing: float = 0.0,
                 swing_period_s: float = 4 * INTERVAL_S) -> None:
        self.topo, self.max_tokens = topo, max_tokens
        self.client = client_of(topo)
        self.rate, self.swing, self.swing_period_s = rate, swing, swing_period_s
        self._pool = ThreadPoolExecutor(max_workers=64)
        self._futures: list[Future[Outcome]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = due = time.monotonic()
        while not self._stop.wait(max(due - time.monotonic(), 0)):
            self._futures.append(self._pool.submit(stream_completion, self.topo,
                                                   self.max_tokens, None, self.client))
            phase = 2 * math.pi * (due - start) / self.swing_period_s
            due += 1 / (self.rate + self.swing * math.sin(phase))

    def failures(self) -> list[str]:
        """The errors and short answers of the requests finished so far."""
        return [f.result().error or f"{f.result().tokens} tokens"
                for f in list(self._futures) if f.done() and (
                    f.result().error or f.result().tokens != self.max_tokens)]

    def stop(self) -> tuple[int, list[str]]:
        """Stops sending, waits for what was sent; (requests sent, failures)."""
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        return len(self._futures), self.failures()


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float,
             poll_s: float = 0.25) -> T:
    """`check()`'s first truthy answer; fails naming `what` after `timeout_s`. The state the
    tests wait on (the router's members, the planner's report) has no push signal, so this
    looks at it a few times a second."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        pause.wait(poll_s)


def frontend_counter(topo: Topology, name: str) -> float:
    """A counter of the frontend's /metrics page, summed over its labels."""
    with urllib.request.urlopen(topo.http_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "_total"))


def pool(topo: Topology, name: str = "decode") -> PoolSnapshot:
    """The pool as the router lists it now."""
    async def ask() -> list[PoolSnapshot]:
        async with RouterStatusClient(topo.router_address) as client:
            return await client.list_workers()

    return next(p for p in asyncio.run(ask()) if p.name == name)


def candidates(topo: Topology) -> int:
    return sum(w.candidate for w in pool(topo).workers)


def launcher_state(topo: Topology) -> dict[str, Any]:
    state = read_state(state_path(int(topo.router_address.rpartition(":")[2])))
    assert state is not None, "no tandem up state file"
    return state


def report(topo: Topology) -> dict[str, Any]:
    """The planner's report (its targets, last decisions and reasons)."""
    body = read_report(launcher_state(topo)["planner_status"])
    assert body is not None
    return body


def decisions_after(topo: Topology, interval: int, pid: int | None = None
                    ) -> list[dict[str, Any]]:
    """The report's decisions later than `interval` (of planner process `pid`, if given)."""
    body = report(topo)
    if pid is not None and body["pid"] != pid:
        return []
    return [d for d in body["decisions"] if d["interval"] > interval]


def kill_planner(topo: Topology) -> int:
    """SIGKILL to the planner process; its pid."""
    pid = next(s["pid"] for s in launcher_state(topo)["services"] if s["name"] == "planner")
    os.kill(pid, signal.SIGKILL)
    return int(pid)
