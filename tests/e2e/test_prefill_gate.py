"""Late binding of prompts to prefill workers through `tandem up --disagg
--frontend-prefill-queue-tokens` (mock engine in real time, prompts prefilled in 16-token
chunks so that each takes a while): with a bound below one prompt, each prefill worker is sent
one prompt at a time and the rest wait in the frontend (its
tandem_frontend_prefill_gate_waiting gauge), every request completes, and both workers end
idle. tests/unit/test_prefill_gate.py checks the order and the ways out of a wait."""
from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.disagg_probe import wait_idle
from tests.e2e.topology import Topology, start_topology

PROMPT_TOKENS = 120


@pytest.fixture(scope="module")
def gated() -> Iterator[Topology]:
    topo = start_topology("--engine", "mock", "--speedup-ratio", "1", "--max-num-tokens", "16",
                          "--frontend-prefill-queue-tokens", str(PROMPT_TOKENS - 20),
                          num_prefill=2)
    yield topo
    assert topo.stop() == 0


def waiting(topo: Topology) -> float:
    with urllib.request.urlopen(topo.http_url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.findall(r'^tandem_frontend_prefill_gate_waiting\{[^}]*\} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


def test_prompts_wait_in_the_frontend_and_all_complete(gated: Topology) -> None:
    prompts = [list(range(10 + i, 10 + i + PROMPT_TOKENS)) for i in range(8)]
    client = openai.OpenAI(base_url=gated.http_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    answers: dict[int, int] = {}
    seen_waiting: list[float] = []
    done = threading.Event()

    def ask(i: int) -> None:
        out = client.completions.create(model=gated.model, prompt=prompts[i], max_tokens=6,
                                        temperature=0, seed=1)
        answers[i] = out.usage.completion_tokens

    def watch() -> None:
        while not done.is_set():
            try:
                seen_waiting.append(waiting(gated))
            except OSError:  # a scrape that failed: the next one counts
                pass
            done.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=ask, args=(i,), daemon=True)
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    watcher.join()
    assert answers == dict.fromkeys(range(len(prompts)), 6)
    assert max(seen_waiting, default=0) >= 1, "no prompt ever waited in the frontend"
    assert waiting(gated) == 0
    wait_idle(*gated.decode_addresses, *gated.prefill_addresses)
