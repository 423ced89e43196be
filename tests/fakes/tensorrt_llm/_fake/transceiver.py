"""A stand-in for TensorRT-LLM's cache transceiver (UCX/NIXL upstream), over loopback TCP so
that it works across processes.

Upstream behaviour it keeps (tensorrt_llm/_torch/pyexecutor/py_executor.py
`_send_disagg_ctx_cache`; ai-dynamo/dynamo PRs #7489 and #14507):
- a context-only request that finished by length hands its blocks to the transceiver; they
  stay allocated until the generation side has pulled them, or until
  cache_transceiver_config.kv_transfer_timeout_ms expires; aborting the context request
  then is a no-op;
- `opaque_state` is what the generation side needs to find the sender (here JSON:
  endpoint + context request id);
- the generation side allocates its blocks first, then receives.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable


class TransferError(RuntimeError):
    pass


class Sender:
    def __init__(self, timeout_ms: int | None, on_done: Callable[[int], None]) -> None:
        self._timeout_ms = timeout_ms
        self._on_done = on_done
        self._held: dict[int, list[int]] = {}
        self._server: asyncio.Server | None = None
        self.endpoint = ""

    @property
    def num_held(self) -> int:
        return len(self._held)

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            host, port = self._server.sockets[0].getsockname()[:2]
            self.endpoint = f"{host}:{port}"

    def opaque_state(self, ctx_request_id: int) -> bytes:
        return json.dumps({"endpoint": self.endpoint, "ctx_request_id": ctx_request_id}).encode()

    def hold(self, ctx_request_id: int, tokens: list[int]) -> None:
        self._held[ctx_request_id] = tokens
        if self._timeout_ms is not None:
            asyncio.get_running_loop().call_later(self._timeout_ms / 1000, self._expire,
                                                  ctx_request_id)

    def _expire(self, ctx_request_id: int) -> None:
        if self._held.pop(ctx_request_id, None) is not None:
            self._on_done(ctx_request_id)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ask = json.loads(await reader.readline())
            tokens = self._held.pop(int(ask["ctx_request_id"]), None)
            if tokens is None:
                reply = {"ok": False, "error": f"context request {ask['ctx_request_id']} has no "
                         "KV cache to send (finished, expired or unknown)"}
            else:
                self._on_done(int(ask["ctx_request_id"]))
                reply = {"ok": True, "tokens": tokens}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


async def receive(opaque_state: bytes, ctx_request_id: int, delay_s: float) -> list[int]:
    """Pulls a context request's KV (its prompt tokens, in the fake) from the sender."""
    await asyncio.sleep(delay_s)
    state = json.loads(opaque_state)
    host, _, port = state["endpoint"].rpartition(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError as exc:
        raise TransferError(f"cannot reach the context server at {state['endpoint']}: {exc}") \
            from exc
    try:
        writer.write(json.dumps({"ctx_request_id": ctx_request_id}).encode() + b"\n")
        await writer.drain()
        reply = json.loads(await reader.readline())
    finally:
        writer.close()
    if not reply["ok"]:
        raise TransferError(reply["error"])
    tokens: list[int] = reply["tokens"]
    return tokens
