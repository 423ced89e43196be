"""The commands in README.md and docs/ work: every shell block is either marked runnable
(```bash runnable) and run here, against one `tandem up --engine mock` on free ports, or says
why it cannot run in CI (```bash no-ci: <why>). Python blocks marked runnable run too.

Blocks are written with the default addresses a reader's `tandem up` has; before running one,
the test replaces them with its stack's (http://127.0.0.1:8000, 127.0.0.1:8001, the router's
127.0.0.1:9100) and also exports them as $TANDEM_URL, $TANDEM_GRPC and $TANDEM_ROUTER. In shell
blocks curl fails on an HTTP error (--fail-with-body), so a 4xx is a failed block."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.topology import ROOT, Topology, start_topology

SHELLS = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^```\s*$", re.M | re.S)
BLOCK_TIMEOUT_S = 30
CURL_FAILS = 'curl() { command curl --fail-with-body --show-error "$@"; }\n'


@dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int
    lang: str
    info: str
    body: str

    @property
    def runnable(self) -> bool:
        return self.info.split()[:1] == ["runnable"]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks() -> Iterator[Block]:
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            yield Block(path, text.count("\n", 0, match.start()) + 1, match["lang"],
                        match["info"].strip(), match["body"])


def test_every_shell_block_is_runnable_or_says_why_not() -> None:
    unmarked = [b.where for b in blocks() if b.lang in SHELLS and not b.runnable
                and not re.match(r"no-ci:\s*\S", b.info)]
    assert not unmarked, ("shell blocks without `runnable` or `no-ci: <why>`: "
                          + ", ".join(unmarked))


def test_a_failing_command_fails_its_block(stack: Topology) -> None:
    bad = Block(ROOT / "README.md", 0, "bash", "runnable",
                "curl -s http://127.0.0.1:8000/v1/chat/completions -d '{\"model\": \"none\"}'\n")
    with pytest.raises(AssertionError, match="exited 22"):
        test_runnable_block(bad, stack)


def test_the_docs_have_runnable_blocks_on_each_api_page() -> None:
    runnable = {b.path.relative_to(ROOT).as_posix() for b in blocks() if b.runnable}
    for page in ("README.md", "docs/deployment.md", "docs/observability.md",
                 "docs/api/openai.md", "docs/api/responses.md", "docs/api/anthropic.md",
                 "docs/api/grpc.md"):
        assert page in runnable, page


@pytest.fixture(scope="module")
def stack() -> Iterator[Topology]:
    topology = start_topology("--engine", "mock", "--speedup-ratio", "0")
    yield topology
    topology.stop()


RUNNABLE = [b for b in blocks() if b.runnable]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_block(block: Block, stack: Topology) -> None:
    body = (block.body.replace("http://127.0.0.1:8000", stack.http_url)
            .replace("127.0.0.1:8001", stack.grpc_address)
            .replace("127.0.0.1:9100", stack.router_address))
    env = {**os.environ, "TANDEM_URL": stack.http_url, "TANDEM_GRPC": stack.grpc_address,
           "TANDEM_ROUTER": stack.router_address,
           # `tandem` and `python` are this interpreter's, as after `make up`.
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if block.lang in SHELLS:
        # An HTTP error must fail the block, not print an error body with exit status 0.
        argv = ["bash", "-euo", "pipefail", "-c", CURL_FAILS + body]
    elif block.lang == "python":
        argv = [sys.executable, "-c", body]
    else:
        pytest.fail(f"{block.where}: a runnable block must be bash or python, not {block.lang!r}")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, (f"{block.where} exited {done.returncode}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
