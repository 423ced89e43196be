"""The public gRPC Inference API from another language: a Node.js client (tests/node/) that knows
nothing of Tandem but the .proto files streams a chat answer from a running topology.

Needs `node` and `npm` (node_modules is installed with `npm ci` from the committed lock file when
missing) and the `topology` fixture of tests/e2e/conftest.py (a running mock-engine topology).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
from typing import Any

import pytest

NODE_DIR = pathlib.Path(__file__).resolve().parents[1] / "node"
CLIENT = NODE_DIR / "inference_client.js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="node (Node.js) is not installed")


@pytest.fixture(scope="session")
def node_client() -> pathlib.Path:
    """The client script, with its npm dependencies installed from package-lock.json."""
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm is not None, "node is installed but npm is not: cannot install tests/node"
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            check=True,
            timeout=300,
        )
    return CLIENT


def run_client(
    node_client: pathlib.Path, topology: Any, model: str, prompt: str, max_tokens: int
) -> tuple[int, list[dict[str, Any]], str]:
    """Runs the client; returns its exit status, its stdout parsed line by line, and stderr."""
    proc = subprocess.run(
        [
            NODE,
            str(node_client),
            topology.grpc_address,
            str(topology.protos_root),
            model,
            prompt,
            str(max_tokens),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "TANDEM_CLIENT_DEADLINE_S": "60"},
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines, proc.stderr


def test_node_client_streams_a_chat_answer(node_client: pathlib.Path, topology: Any) -> None:
    max_tokens = 12
    rc, lines, stderr = run_client(
        node_client, topology, topology.model, "Tell me about tandem bicycles.", max_tokens
    )
    assert rc == 0, f"client failed: {lines} {stderr}"

    models = next(line["models"] for line in lines if "models" in line)
    assert topology.model in [card["id"] for card in models]

    chunks = [line for line in lines if "token_ids" in line]
    assert len(chunks) >= 2, f"expected a streamed answer, got {len(chunks)} chunk(s): {lines}"
    assert len({chunk["request_id"] for chunk in chunks}) == 1

    done = lines[-1]
    assert done.get("done") is True, lines
    assert done["finish_reason"] not in (None, "FINISH_REASON_UNSPECIFIED")
    assert done["usage"] is not None, "the last chunk carries no usage"
    # The mock engine never emits EOS, so every request runs to max_tokens.
    assert done["num_tokens"] == done["usage"]["completion_tokens"] == max_tokens
    assert done["usage"]["prompt_tokens"] > 0
    assert done["text"].strip()
    assert done["text"] == "".join(chunk["text"] for chunk in chunks)


def test_node_client_unknown_model_is_not_found(node_client: pathlib.Path, topology: Any) -> None:
    rc, lines, stderr = run_client(node_client, topology, "no-such-model", "Hello", 4)
    assert rc == 1, f"expected failure, got {rc}: {lines} {stderr}"
    error = lines[-1]["error"]
    assert error["code"] == 5, error  # grpc NOT_FOUND
    assert error["details"]
