"""The frontend's client of the router replicas: Route calls spread over every replica that is up,
failover to the next when one cannot be reached, and routing of its own (FallbackRouter) while
none can, so that no router process is a single point of failure.

A replica that fails a call at the transport (or answers that it is still starting) is down
until its health says SERVING again (router_replicas.py). A replica's own verdict ("no healthy worker") is an answer, not an outage: it is raised, not failed over.
Completions go back to the replica that counted the request, riding on its next Route or, when
none comes within `flush_ms`, in one Complete call.

With `local_routing` the client decides itself, in process (tandem.routing.local), once it has
the routers' worker list and has rebuilt the prefix index from the workers' event streams; a
replica is asked only before that, or when the local router finds no candidate (a router may
reach a worker this process cannot). It then takes the routers' list every `snapshot_interval_s`
whether or not requests flow, so that a worker the routers take on (a DNS pool grown) is routed
to from this process within that time plus its streams' start.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from opentelemetry.trace import SpanKind

from tandem.errors import Unavailable
from tandem.routing.fallback import FallbackRouter
from tandem.routing.local import LocalRouter
from tandem.routing.router import RouteRequestInfo
from tandem.routing.snapshot import PoolSnapshot
from tandem.routing.workers import RouteDecision, SlaHints, WorkerRef
from tandem.runtime import status, tracing
from tandem.runtime.interceptor import REQUEST_ID_KEY
from tandem.runtime.router_replicas import (
    Replica,
    ReplicaState,
    RouterReplicas,
    split_addresses,
)
from tandem.runtime.router_status import ROUTER_VERDICT_KEY
from tandem.runtime.tasks import spawn
from tandem.runtime.tls import TlsConfig
from tandem.runtime.worker_lists import OUTAGE_CODES, WorkerLists
from tandem.v1 import router_pb2

log = logging.getLogger(__name__)
_OUTCOMES = {"ok": router_pb2.OUTCOME_OK, "error": router_pb2.OUTCOME_ERROR,
             "cancelled": router_pb2.OUTCOME_CANCELLED}
#: Completions kept for a replica that is down (the oldest go first past it).
MAX_PENDING = 65_536


def _ref(msg: router_pb2.WorkerRef) -> WorkerRef:
    return WorkerRef(msg.worker_id, msg.address, msg.pool)


class _Outage(Exception):
    """A replica could not answer (the call is tried on the next one)."""


class RouterClient:
    """Route and Complete over one or more router replicas, with routing of its own while none
    answers (see the module docstring).

    Args:
        addresses: the replicas, `host:port` each (a comma-separated string or a list); a
            `dns:host:port` entry stands for every address the name resolves to, re-resolved
            every `dns_refresh_s` (a Kubernetes headless Service over the router's pods).
        on_fallback: told True when the client starts routing alone, False when a replica is
            back (metrics).
        on_fallback_route: told of each request routed without a router (metrics).
        local_routing: decide in this process once ready (module docstring).
        on_local_route: told of each request routed in this process (metrics).
        on_local_candidates: told, at each list taken, of the local router's candidates by
            pool kind (metrics).
    """

    def __init__(self, addresses: str | Sequence[str], flush_ms: float = 20.0,
                 timeout_s: float = 10.0, max_local_prefill_length: int = 0,
                 tls: TlsConfig | None = None, block_size: int = 32,
                 snapshot_interval_s: float = 2.0, dns_refresh_s: float = 10.0,
                 on_fallback: Callable[[bool], None] = lambda active: None,
                 on_fallback_route: Callable[[], None] = lambda: None,
                 local_routing: bool = False,
                 on_local_route: Callable[[], None] = lambda: None,
                 on_local_candidates: Callable[[dict[str, int]], None] = lambda _: None
                 ) -> None:
        self.addresses = split_addresses(addresses)
        if not self.addresses:
            raise ValueError("RouterClient needs at least one router address")
        self.address = ",".join(self.addresses)
        #: Conditional disaggregation threshold sent with every Route (RouteRequest field).
        self.max_local_prefill_length = max_local_prefill_length
        #: Longest wait for a Route answer when the request itself has no nearer deadline.
        self.timeout_s = timeout_s
        self.flush_s = flush_ms / 1000
        self.replicas = RouterReplicas(self.addresses, tls, dns_refresh_s, self._on_back)
        #: Request id -> the replica that counted it; None: routed here (fallback).
        self._routed_by: dict[str, Replica | None] = {}
        self.fallback = FallbackRouter(block_size)
        self.local = LocalRouter(tls) if local_routing else None
        #: Requests routed by `local` and not completed yet.
        self._routed_locally: set[str] = set()
        self._on_local_route = on_local_route
        self._on_fallback = on_fallback
        self._on_fallback_route = on_fallback_route
        self.is_fallback_active = False
        #: List refreshes (cancelled at close), and completion flushes (awaited).
        self._background: set[asyncio.Task[None]] = set()
        self._flushes: set[asyncio.Task[None]] = set()
        #: The routers' worker list, for `fallback` and `local`.
        self.lists = WorkerLists(self.address, self.replicas, self.fallback, self.local,
                                 snapshot_interval_s, timeout_s, on_local_candidates,
                                 self._background)

    def start(self) -> None:
        """Follows the DNS names, and takes the first worker list (the fallback's) from the
        first replica that answers, in the background. Call on the event loop."""
        self.replicas.start()
        self.lists.start()

    def replica_states(self) -> list[str]:
        """Each replica's state ("up" or "down")."""
        return self.replicas.states()

    def _on_back(self, replica: Replica) -> None:
        if replica.pending:
            self._start_flush(replica)
        self.lists.refresh_soon()

    # ---- routing ----------------------------------------------------------------------------

    async def route(self, request_id: str, token_ids: list[int], expected_osl: int,
                    sla: SlaHints, exclude_ids: tuple[str, ...] = (),
                    timeout_s: float | None = None, block_hashes: Sequence[int] = (),
                    has_images: bool = False, prefer_ids: tuple[str, ...] = ()
                    ) -> RouteDecision:
        if self.local is not None and self.local.is_ready:
            decision = self._route_locally(RouteRequestInfo(
                request_id, token_ids, block_hashes, len(token_ids), expected_osl, sla,
                exclude_ids, self.max_local_prefill_length, has_images, prefer_ids))
            if decision is not None:
                return decision
        request = router_pb2.RouteRequest(
            request_id=request_id, token_ids=token_ids, isl=len(token_ids),
            expected_osl=expected_osl, exclude_worker_ids=exclude_ids,
            max_local_prefill_length=self.max_local_prefill_length,
            block_hashes=block_hashes, has_images=has_images, prefer_worker_ids=prefer_ids)
        if sla.ttft_ms is not None:
            request.sla.ttft_ms = sla.ttft_ms
        if sla.itl_ms is not None:
            request.sla.itl_ms = sla.itl_ms
        if sla.priority is not None:
            request.priority = sla.priority
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        reply = await self._route(request, timeout)
        if reply is None:
            return self._route_alone(RouteRequestInfo(
                request_id, token_ids, block_hashes, len(token_ids), expected_osl, sla,
                exclude_ids, self.max_local_prefill_length, has_images, prefer_ids))
        return RouteDecision(decode_workers=tuple(_ref(w) for w in reply.decode_workers),
                             prefill_workers=tuple(_ref(w) for w in reply.prefill_workers),
                             encode_workers=tuple(_ref(w) for w in reply.encode_workers),
                             disaggregate=reply.disaggregate,
                             overlap_blocks=reply.overlap_blocks)

    async def route_video(self, request_id: str, exclude_ids: tuple[str, ...] = ()
                          ) -> tuple[WorkerRef, ...]:
        """Video workers for a video request, best first (RouteRequest.video)."""
        return (await self._route_whole(request_id, exclude_ids, video=True)).video_workers

    async def route_embedding(self, request_id: str, exclude_ids: tuple[str, ...] = ()
                              ) -> tuple[WorkerRef, ...]:
        """Embedding workers for an embedding request, best first (RouteRequest.embedding)."""
        return (await self._route_whole(request_id, exclude_ids,
                                        embedding=True)).embedding_workers

    async def _route_whole(self, request_id: str, exclude_ids: tuple[str, ...], *,
                           video: bool = False, embedding: bool = False) -> RouteDecision:
        if self.local is not None and self.local.is_ready:
            decision = self._route_locally(RouteRequestInfo(
                request_id, (), (), 0, 0, SlaHints(), exclude_ids, video=video,
                embedding=embedding))
            if decision is not None:
                return decision
        request = router_pb2.RouteRequest(request_id=request_id, video=video,
                                          embedding=embedding, exclude_worker_ids=exclude_ids)
        reply = await self._route(request, self.timeout_s)
        if reply is None:
            return self._route_alone(RouteRequestInfo(
                request_id, (), (), 0, 0, SlaHints(), exclude_ids, video=video,
                embedding=embedding))
        return RouteDecision(decode_workers=(),
                             video_workers=tuple(_ref(w) for w in reply.video_workers),
                             embedding_workers=tuple(_ref(w) for w in reply.embedding_workers))

    async def _route(self, request: router_pb2.RouteRequest, timeout_s: float
                     ) -> router_pb2.RouteResponse | None:
        """The first replica's answer, in round-robin order over those up; None when none can
        answer (the caller routes alone)."""
        if not self.replicas.resolved.is_set():
            await self.replicas.resolved.wait()
        request_id = request.request_id
        self._forget(request_id)  # a re-routed request is counted where it is routed now
        for replica in self.replicas.up_order():
            try:
                reply = await self._call_route(replica, request, timeout_s)
            except _Outage:
                continue
            self._routed_by[request_id] = replica
            if self.is_fallback_active:
                self._set_fallback(False)
            self.lists.maybe_refresh(replica)
            return reply
        return None

    async def _call_route(self, replica: Replica, request: router_pb2.RouteRequest,
                          timeout_s: float) -> router_pb2.RouteResponse:
        completed = replica.take_pending()
        del request.completed[:]
        request.completed.extend(completed)
        request_id = request.request_id
        with tracing.span("tandem.v1.Router/Route", SpanKind.CLIENT, {
                "rpc.system": "grpc", "rpc.service": "tandem.v1.Router", "rpc.method": "Route",
                "server.address": replica.address}, current=False) as span:
            try:
                return await replica.stub.Route(request, timeout=timeout_s, metadata=(
                    (REQUEST_ID_KEY, request_id), *tracing.inject(span)))
            except BaseException as exc:
                # The router may not have read them: report those completions again
                # (idempotent).
                self._requeue(replica, completed)
                if not isinstance(exc, grpc.aio.AioRpcError):
                    raise
                # The request's own deadline, or the router's verdict on it, is an answer.
                own_deadline = (exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                                and timeout_s < self.timeout_s)
                if exc.code() not in OUTAGE_CODES or own_deadline or _is_verdict(exc):
                    raise status.from_rpc_error(exc, f"router {replica.address}") from None
                self.replicas.mark_down(replica, f"{exc.code().name}: {exc.details()}")
                raise _Outage() from None

    def _route_locally(self, info: RouteRequestInfo) -> RouteDecision | None:
        """The local router's decision; None when it has no candidate for the request (a
        replica is asked then)."""
        assert self.local is not None
        self._forget(info.request_id)
        try:
            decision = self.local.route(info)
        except Unavailable:
            return None
        self._routed_locally.add(info.request_id)
        self._on_local_route()  # the list it routes on is kept fresh by WorkerLists' own loop
        return decision

    def _route_alone(self, info: RouteRequestInfo) -> RouteDecision:
        if not self.is_fallback_active:
            self._set_fallback(True)
        decision = self.fallback.route(info)
        self._routed_by[info.request_id] = None
        self._on_fallback_route()
        return decision

    def _set_fallback(self, active: bool) -> None:
        self.is_fallback_active = active
        self._on_fallback(active)
        if active:
            age = (time.monotonic() - self.fallback.updated_at
                   if self.fallback.updated_at is not None else None)
            log.warning("no router replica answers: routing alone on the last worker list "
                        "(kv-aware routing off until a router is back)", extra={
                            "routers": self.address, "workers": self.fallback.num_workers,
                            "list_age_s": None if age is None else round(age, 1)})
        else:
            log.info("a router replica answers again: routing through it",
                     extra={"routers": self.address})

    async def list_workers(self, timeout_s: float = 5.0) -> list[PoolSnapshot]:
        """Every pool and worker as a replica sees them (WorkerLists.list_workers)."""
        return await self.lists.list_workers(timeout_s)

    # ---- completions ------------------------------------------------------------------------

    def report_completion(self, request_id: str, outcome: str, output_tokens: int) -> None:
        if request_id in self._routed_locally:
            self._routed_locally.discard(request_id)
            assert self.local is not None
            self.local.complete(request_id)
            return
        if request_id not in self._routed_by:
            return
        replica = self._routed_by.pop(request_id)
        if replica is None:
            self.fallback.complete(request_id)
            return
        self._requeue(replica, [router_pb2.Completion(
            request_id=request_id, outcome=_OUTCOMES[outcome], output_tokens=output_tokens)])

    def _forget(self, request_id: str) -> None:
        """A request routed again: its earlier hand-out is released where it was counted."""
        if request_id in self._routed_by or request_id in self._routed_locally:
            self.report_completion(request_id, "error", 0)

    def _requeue(self, replica: Replica, completions: list[router_pb2.Completion]) -> None:
        if not completions:
            return
        replica.pending.extend(completions)
        del replica.pending[:-MAX_PENDING]
        if replica.flush_timer is None and replica.state is ReplicaState.UP:
            replica.flush_timer = asyncio.get_running_loop().call_later(
                self.flush_s, self._start_flush, replica)

    def _start_flush(self, replica: Replica) -> None:
        replica.flush_timer = None
        spawn(self._flush(replica), self._flushes)

    async def _flush(self, replica: Replica) -> None:
        pending = replica.take_pending()
        if not pending:
            return
        try:
            await replica.stub.Complete(router_pb2.CompleteRequest(completions=pending),
                                        timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            # A replica that restarted forgot these anyway; one that blipped corrects its
            # counts with the workers' next load reports.
            log.warning("router Complete failed", extra={
                "router": replica.address, "error": exc.details(), "completions": len(pending)})

    async def flush(self) -> None:
        """Sends every pending completion now."""
        await asyncio.gather(*(self._flush(r) for r in self.replicas.all
                               if r.state is ReplicaState.UP))

    # ---- lifecycle --------------------------------------------------------------------------

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.flush()
        await asyncio.gather(*self._flushes, return_exceptions=True)
        await self.replicas.close()
        if self.local is not None:
            await self.local.close()


def _is_verdict(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed Route is the router's answer about the request (e.g. no healthy
    worker) rather than an outage of the router itself."""
    return any(key == ROUTER_VERDICT_KEY for key, _ in exc.trailing_metadata() or ())
