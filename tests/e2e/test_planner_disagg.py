"""`tandem up --disagg --planner` on the mock engine at speedup 1: the planner sizes the prefill
and the decode pool separately, the prefill pool following the prompt tokens when the prompts
grow while the decode pool, whose streams did not change, keeps its size.

The profiles make each pool's demand a known function of the load (see the asserts on
`prefill_demand` and `decode_demand`)."""
from __future__ import annotations

import json
import pathlib
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import yaml
from tokenizers import Tokenizer

from tandem.model.demo import committed_file
from tests.e2e.planner_load import (
    INTERVAL_S,
    PROFILE,
    Outcome,
    client_of,
    decisions_after,
    pool,
    report,
    wait_for,
)
from tests.e2e.topology import Topology, start_topology

pytestmark = pytest.mark.timeout(300)
OSL = 25
RATE = 5.0
SHORT = "Hello there"
LONG = "word " * 300
#: One prefill worker takes 1,000 prompt tokens per second within its 1,000-ms TTFT target
#: (TTFT = tokens per second, linear between the points), whatever the ISL.
PREFILL_PROFILE = {**PROFILE, "prefill": [
    {"isl": 1, "tokens_per_s": 1, "ttft_ms": 1}, {"isl": 1, "tokens_per_s": 2001, "ttft_ms": 2001},
    {"isl": 4000, "tokens_per_s": 1, "ttft_ms": 1},
    {"isl": 4000, "tokens_per_s": 2001, "ttft_ms": 2001}], "decode": []}
DECODE_PROFILE = {**PROFILE, "prefill": []}


def prompt_tokens(text: str) -> int:
    tok = Tokenizer.from_str(committed_file("tokenizer.json").read_text())
    return len(tok.encode(text).ids)


def prefill_demand(rate: float, isl: int) -> float:
    return rate * isl / 1000


def decode_demand(rate: float, osl: int) -> float:
    """As tests.e2e.planner_load.demand: 2 streams per worker within the 20-ms ITL target."""
    return rate * osl * 0.020 / 2


def start_disagg(tmp: pathlib.Path) -> Topology:
    (tmp / "prefill.json").write_text(json.dumps(PREFILL_PROFILE))
    (tmp / "decode.json").write_text(json.dumps(DECODE_PROFILE))
    plan = {"interval_s": INTERVAL_S, "correction_alpha": 0, "pools": [
        {"name": "prefill", "role": "prefill", "ttft_target_ms": 1000, "min_workers": 1,
         "max_workers": 3, "profile": str(tmp / "prefill.json")},
        {"name": "decode", "role": "decode", "itl_target_ms": 20, "min_workers": 1,
         "max_workers": 3, "profile": str(tmp / "decode.json")}]}
    (tmp / "plan.yaml").write_text(yaml.safe_dump(plan))
    return start_topology("--engine", "mock", "--speedup-ratio", "1", "--planner",
                          "--planner-config", str(tmp / "plan.yaml"), "--grace-period-s", "60",
                          "--frontend-processes", "1", num_prefill=1, restart=True)


class PromptLoad:
    """Streamed completions of `prompt` at `rate` per second (open loop) until `stop`; the
    prompt can be changed while it runs."""

    def __init__(self, topo: Topology, prompt: str) -> None:
        self.topo, self.prompt = topo, prompt
        self.client = client_of(topo)
        self._pool = ThreadPoolExecutor(max_workers=32)
        self._futures: list[Future[Outcome]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.wait(max(due - time.monotonic(), 0)):
            self._futures.append(self._pool.submit(self._one, self.prompt))
            due += 1 / RATE

    def _one(self, prompt: str) -> Outcome:
        out = Outcome()
        try:
            for chunk in self.client.completions.create(
                    model=self.topo.model, prompt=prompt, max_tokens=OSL, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if chunk.usage is not None:
                    out.tokens = chunk.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 (any error is a failed request)
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    def stop(self) -> list[str]:
        """Stops sending, waits for what was sent; the failures."""
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        return [f.result().error or f"{f.result().tokens} tokens" for f in self._futures
                if f.result().error or f.result().tokens != OSL]


def _targets(decision: dict[str, Any]) -> dict[str, int]:
    return {p["pool"]: p["target"] for p in decision["pools"]}


def _steady(topo: Topology, want: dict[str, int], since: int) -> list[dict[str, Any]] | None:
    """The last 2 decisions after `since`, when both target `want`."""
    last = decisions_after(topo, since)[-2:]
    return last if len(last) == 2 and all(_targets(d) == want for d in last) else None


def test_prefill_and_decode_pools_are_sized_separately(tmp_path: pathlib.Path) -> None:
    short, long = prompt_tokens(SHORT), prompt_tokens(LONG)
    # Short prompts: decode needs 2 workers, prefill 1; long ones: prefill needs 2, decode
    # still 2 (the decode profile is one context length: its capacity does not change).
    assert decode_demand(RATE, OSL) == 1.25
    assert prefill_demand(RATE, short) < 1 < prefill_demand(RATE, long) < 2
    topo = start_disagg(tmp_path)
    load = PromptLoad(topo, SHORT)
    try:
        last = wait_for("decode at 2 and prefill at 1",
                        lambda: _steady(topo, {"prefill": 1, "decode": 2}, -1), 120)[-1]
        # A worker of an earlier, larger target may still be draining: the router lists it until
        # it exited.
        wait_for("the router at 2 decode workers and 1 prefill worker",
                 lambda: (len(pool(topo, "decode").workers), len(pool(topo, "prefill").workers))
                 == (2, 1), 90)
        load.prompt = LONG
        # The mean ISL of the requests that finished in an interval moves over one interval,
        # the predictor's trend over three: the prefill pool grows within a few.
        grown = wait_for("prefill at 2, decode still at 2",
                         lambda: _steady(topo, {"prefill": 2, "decode": 2},
                                         last["interval"]), 120)
        prefill = next(p for p in grown[-1]["pools"] if p["pool"] == "prefill")
        # ... sized on the long prompts' tokens (the predicted ISL: the last intervals' mean
        # plus their trend, so near the long prompts' length but not exactly it).
        isl = int(re.search(r"at ISL (\d+)", prefill["reason"]).group(1))  # type: ignore[union-attr]
        assert long / 2 < isl < long * 2, prefill
        wait_for("2 prefill workers listed by the router",
                 lambda: len(pool(topo, "prefill").workers) == 2, 60)
        # Decode never changed size: every decision since the first kept it at 2 once there.
        since = [d for d in report(topo)["decisions"] if d["interval"] > last["interval"]]
        assert all(_targets(d)["decode"] == 2 for d in since), since
        assert len(pool(topo, "decode").workers) == 2
    finally:
        failures = load.stop()
        assert topo.stop() == 0
    assert failures == []
