"""The health canary: a one-token greedy request that proves the engine makes progress.

As Dynamo's TensorRT-LLM health check (components/src/dynamo/trtllm/health_check.py): the
prompt is the model's BOS token (or 1), max_tokens 1, and prefill and decode workers send it as
request_type "context_and_generation" so that it runs whole without a peer worker.
"""
from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

from tandem.errors import Unavailable


def bos_token(model_dir: str) -> int:
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    bos = config.get("text_config", config).get("bos_token_id", config.get("bos_token_id"))
    bos = bos[0] if isinstance(bos, list) and bos else bos
    return bos if isinstance(bos, int) else 1


async def _finished(result: Any) -> None:
    await result


async def await_canary(result: Any, timeout_s: float) -> None:
    """Waits for the canary's result.

    Raises:
        Unavailable: the engine failed the request, or produced no token within timeout_s.
    """
    try:
        await asyncio.wait_for(_finished(result), timeout_s)
    except asyncio.TimeoutError as exc:
        result.abort()
        raise Unavailable(f"TensorRT-LLM made no progress in {timeout_s:g} s") from exc
    except Exception as exc:  # RequestError: the engine failed the request
        raise Unavailable(f"TensorRT-LLM failed the health canary: {exc}") from exc
    if not result.outputs[0].token_ids:
        raise Unavailable("TensorRT-LLM finished the health canary without a token")
