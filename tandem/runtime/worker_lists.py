"""The routers' worker list in a frontend process, for its fallback router and its local router:
taken from the first replica that answers at start, then again at most every `interval_s` while
requests flow and, with a local router, every `interval_s` whether or not they flow (so that a
worker the routers take on is routed to from this process within that time)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from tandem.errors import Unavailable
from tandem.routing.fallback import FallbackRouter
from tandem.routing.local import LocalRouter
from tandem.routing.snapshot import PoolSnapshot
from tandem.runtime import status
from tandem.runtime.router_replicas import Replica, RouterReplicas
from tandem.runtime.router_status import pools_from_pb, settings_from_pb
from tandem.runtime.tasks import spawn
from tandem.v1 import router_pb2

log = logging.getLogger(__name__)
#: Codes of a call that says nothing about the request: the replica is gone, hung or starting.
OUTAGE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                          grpc.StatusCode.CANCELLED})
#: Between two attempts at the first worker list.
FIRST_LIST_S = (0.1, 0.2, 0.5, 1.0)


class WorkerLists:
    """Takes the routers' ListWorkers answers into `fallback` and `local` (module docstring).

    Args:
        routers: the replicas' addresses as configured, for messages.
        on_local_candidates: told, at each list taken, of the local router's candidates by
            pool kind (metrics).
        background: the owner's set of background tasks (cancelled at its close).
    """

    def __init__(self, routers: str, replicas: RouterReplicas, fallback: FallbackRouter,
                 local: LocalRouter | None, interval_s: float, timeout_s: float,
                 on_local_candidates: Callable[[dict[str, int]], None],
                 background: set[asyncio.Task[None]]) -> None:
        self.routers = routers
        self.replicas = replicas
        self.fallback = fallback
        self.local = local
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_local_candidates = on_local_candidates
        self._background = background
        self._task: asyncio.Task[None] | None = None
        self._due = 0.0

    def start(self) -> None:
        """Call on the event loop."""
        self._task = spawn(self._first(), self._background)
        self._task.add_done_callback(self._done)
        if self.local is not None:
            spawn(self._follow(), self._background)

    def refresh_soon(self) -> None:
        """The next request takes a fresh list (a replica is back)."""
        self._due = 0.0

    async def _first(self) -> None:
        await self.replicas.resolved.wait()
        attempt = 0
        while self.fallback.updated_at is None:
            for replica in self.replicas.up_order():
                await self._refresh(replica)
                if self.fallback.updated_at is not None:
                    return
            await asyncio.sleep(FIRST_LIST_S[min(attempt, len(FIRST_LIST_S) - 1)])
            attempt += 1

    async def _follow(self) -> None:
        """With local routing: the list from an up replica every `interval_s`, idle or not."""
        while True:
            await asyncio.sleep(self.interval_s)
            replica = next(iter(self.replicas.up_order()), None)
            if replica is not None and self._task is None:
                await asyncio.wait([self._start(replica)])

    def maybe_refresh(self, replica: Replica) -> None:
        """Keeps the list at most `interval_s` old while requests flow."""
        if time.monotonic() < self._due or self._task is not None:
            return
        self._start(replica)

    def _start(self, replica: Replica) -> asyncio.Task[None]:
        self._due = time.monotonic() + self.interval_s
        task = self._task = spawn(self._refresh(replica), self._background)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        if self._task is task:
            self._task = None

    async def _refresh(self, replica: Replica) -> None:
        try:
            reply = await replica.stub.ListWorkers(router_pb2.ListWorkersRequest(),
                                                   timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("ListWorkers failed", extra={"router": replica.address,
                                                   "error": exc.details()})
        else:
            self._take(reply)

    def _take(self, reply: router_pb2.ListWorkersResponse) -> list[PoolSnapshot]:
        pools = pools_from_pb(reply)
        self.fallback.update(pools, time.monotonic())
        settings = settings_from_pb(reply)
        if self.local is not None and settings is not None:
            self.local.update(pools, settings)
            self._on_local_candidates(self.local.candidate_counts())
        return pools

    async def list_workers(self, timeout_s: float = 5.0) -> list[PoolSnapshot]:
        """Every pool and worker as a replica sees them (the first that answers); the last
        list taken when none does.

        Raises:
            Unavailable: no replica answers and no list was ever taken.
        """
        for replica in self.replicas.up_order():
            try:
                reply = await replica.stub.ListWorkers(router_pb2.ListWorkersRequest(),
                                                       timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in OUTAGE_CODES:
                    self.replicas.mark_down(replica, f"{exc.code().name}: {exc.details()}")
                    continue
                raise status.from_rpc_error(exc, f"router {replica.address}") from None
            return self._take(reply)
        last = self.fallback.pools()
        if last is None:
            raise Unavailable(f"no router answers ({self.routers})")
        return last
