"""gRPC clients the frontend uses to reach the router and workers. They speak domain types and
raise typed errors, so the request pipeline above them has no grpc import."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import grpc

from tandem.engines.types import EngineRequest, TokenChunk
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef
from tandem.runtime import convert, status
from tandem.runtime.interceptor import REQUEST_ID_KEY
from tandem.v1 import decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)
_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024)]
_OUTCOMES = {"ok": router_pb2.OUTCOME_OK, "error": router_pb2.OUTCOME_ERROR,
             "cancelled": router_pb2.OUTCOME_CANCELLED}


def _ref(msg: router_pb2.WorkerRef) -> WorkerRef:
    return WorkerRef(msg.worker_id, msg.address, msg.pool)


class RouterClient:
    """Route calls plus batched completion reports.

    Completions ride on the next Route call; if none comes within `flush_ms` they go out in one
    Complete call. Under load that saves an RPC per request on both sides; when idle the router
    learns of a completion at most `flush_ms` late.
    """

    def __init__(self, address: str, flush_ms: float = 20.0, timeout_s: float = 10.0) -> None:
        self.address = address
        #: Longest wait for a Route answer when the request itself has no nearer deadline.
        self.timeout_s = timeout_s
        self.flush_s = flush_ms / 1000
        self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._pending: list[router_pb2.Completion] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    def _take_pending(self) -> list[router_pb2.Completion]:
        pending, self._pending = self._pending, []
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        return pending

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None) -> RouteDecision:
        completed = self._take_pending()
        request = router_pb2.RouteRequest(
            request_id=request_id, token_ids=token_ids, isl=len(token_ids),
            expected_osl=expected_osl, exclude_worker_ids=exclude_ids, completed=completed)
        if sla.ttft_ms is not None:
            request.sla.ttft_ms = sla.ttft_ms
        if sla.itl_ms is not None:
            request.sla.itl_ms = sla.itl_ms
        if sla.priority is not None:
            request.priority = sla.priority
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            reply = await self._stub.Route(request, timeout=timeout,
                                           metadata=((REQUEST_ID_KEY, request_id),))
        except BaseException as exc:
            # The router may not have read them: report those completions again (idempotent).
            self._requeue(completed)
            if isinstance(exc, grpc.aio.AioRpcError):
                raise status.from_rpc_error(exc, f"router {self.address}") from None
            raise
        return RouteDecision(decode_workers=tuple(_ref(w) for w in reply.decode_workers),
                             prefill_workers=tuple(_ref(w) for w in reply.prefill_workers),
                             encode_workers=tuple(_ref(w) for w in reply.encode_workers),
                             disaggregate=reply.disaggregate,
                             overlap_blocks=reply.overlap_blocks)

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        self._requeue([router_pb2.Completion(
            request_id=request_id, outcome=_OUTCOMES[outcome], output_tokens=output_tokens)])

    def _requeue(self, completions: list[router_pb2.Completion]) -> None:
        if not completions:
            return
        self._pending.extend(completions)
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(self.flush_s,
                                                                      self._start_flush)

    def _start_flush(self) -> None:
        self._flush_timer = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self) -> None:
        """Sends every pending completion now."""
        pending = self._take_pending()
        if not pending:
            return
        try:
            await self._stub.Complete(router_pb2.CompleteRequest(completions=pending),
                                      timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            # The router keeps counting these until it restarts; nothing else to do here.
            log.warning("router Complete failed", extra={"error": exc.details(),
                                                         "completions": len(pending)})

    async def close(self) -> None:
        await self.flush()
        if self._flushes:
            await asyncio.gather(*self._flushes)
        await self._channel.close()


class DecodeClients:
    """One channel per decode worker address, opened on first use."""

    def __init__(self) -> None:
        self._stubs: dict[str, decode_pb2_grpc.DecodeStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[address] = decode_pb2_grpc.DecodeStub(channel)
        return stub

    async def generate(self, address: str, request: EngineRequest,
                       timeout_s: float | None = None) -> AsyncGenerator[TokenChunk, None]:
        """Streams chunks from the worker; closing the iterator cancels the call."""
        message = decode_pb2.GenerateRequest(
            request_id=request.request_id, token_ids=request.prompt_token_ids,
            sampling=convert.sampling_to_pb(request.sampling))
        call = self._stub(address).Generate(
            message, timeout=timeout_s, metadata=((REQUEST_ID_KEY, request.request_id),))
        try:
            async for msg in call:
                yield TokenChunk(
                    list(msg.token_ids),
                    [convert.logprob_from_pb(lp) for lp in msg.logprobs] if msg.logprobs else [],
                    convert.finish_from_pb(msg.finish_reason),
                    convert.usage_from_pb(msg.usage) if msg.HasField("usage") else None,
                    msg.cached_tokens if msg.HasField("cached_tokens") else None)
        except grpc.aio.AioRpcError as exc:
            raise status.from_rpc_error(exc, f"decode worker {address}") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
