"""The router replicas a frontend knows: who they are (static addresses, and DNS names expanded
to every address behind them, re-resolved), which are up, and the order to try them in.

A replica that failed a call is down: it is skipped while a probe watches its grpc.health.v1
status, and it is up again once that says SERVING (a restarted router says so only after its
index is rebuilt from the workers' event streams).
"""
from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.runtime import dns
from tandem.runtime.dns import DNS_PREFIX
from tandem.runtime.tasks import spawn
from tandem.runtime.tls import TlsConfig, aio_channel
from tandem.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)
_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            # Reconnect soon after a router restarts, not after gRPC's default 1-120 s back-off.
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2_000)]
#: Between two health probes of a replica that is down.
PROBE_S = (0.1, 0.2, 0.5, 1.0)


def split_addresses(addresses: str | Sequence[str]) -> list[str]:
    """`host:port[,host:port...]` (or a list of them) as a list, blanks dropped."""
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    return [a.strip() for item in items for a in item.split(",") if a.strip()]


class ReplicaState(enum.Enum):
    UP = "up"
    DOWN = "down"


@dataclass
class Replica:
    """One router replica: its channel, its state, and the completions owed to it."""

    address: str
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub
    state: ReplicaState = ReplicaState.UP
    pending: list[router_pb2.Completion] = field(default_factory=list)
    flush_timer: asyncio.TimerHandle | None = None
    probe: asyncio.Task[None] | None = None
    #: Health checks answered while it was down (for tests and logs).
    num_probe_answers: int = 0

    def take_pending(self) -> list[router_pb2.Completion]:
        pending, self.pending = self.pending, []
        if self.flush_timer is not None:
            self.flush_timer.cancel()
            self.flush_timer = None
        return pending


class RouterReplicas:
    """Args:
        addresses: `host:port` each, or `dns:host:port` for every address the name resolves
            to (re-resolved every `dns_refresh_s`).
        on_back: told of a replica that is up again (to send what it is owed).
    """

    def __init__(self, addresses: Sequence[str], tls: TlsConfig | None,
                 dns_refresh_s: float = 10.0,
                 on_back: Callable[[Replica], None] = lambda replica: None) -> None:
        self._tls = tls
        self._static = [a for a in addresses if not a.startswith(DNS_PREFIX)]
        self._dns_names = [a.removeprefix(DNS_PREFIX) for a in addresses
                           if a.startswith(DNS_PREFIX)]
        self.dns_refresh_s = dns_refresh_s
        self._on_back = on_back
        self.all: list[Replica] = []
        self._retired: list[Replica] = []
        self._next = 0
        self._tasks: set[asyncio.Task[None]] = set()
        #: Set once the DNS names resolved the first time (at once without any).
        self.resolved = asyncio.Event()
        self._set(self._static)
        if not self._dns_names:
            self.resolved.set()

    def start(self) -> None:
        """Follows the DNS names, if any. Call on the event loop."""
        if self._dns_names:
            spawn(self._follow_dns(), self._tasks)

    def up_order(self) -> list[Replica]:
        """The replicas that are up, each call starting one further along (round robin)."""
        up = [r for r in self.all if r.state is ReplicaState.UP]
        if not up:
            return []
        self._next = (self._next + 1) % len(up)
        return up[self._next:] + up[:self._next]

    def states(self) -> list[str]:
        """Each replica's state ("up" or "down"), in order."""
        return [r.state.value for r in self.all]

    def mark_down(self, replica: Replica, why: str) -> None:
        """Takes `replica` out of the order until its health says SERVING."""
        if replica.state is ReplicaState.DOWN:
            return
        replica.state = ReplicaState.DOWN
        log.warning("router replica down; probing its health",
                    extra={"router": replica.address, "error": why})
        replica.probe = spawn(self._probe(replica), self._tasks)

    async def _probe(self, replica: Replica) -> None:
        stub = health_pb2_grpc.HealthStub(replica.channel)
        attempt = 0
        while True:
            await asyncio.sleep(PROBE_S[min(attempt, len(PROBE_S) - 1)])
            attempt += 1
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            except grpc.aio.AioRpcError:
                continue
            replica.num_probe_answers += 1
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
        replica.state, replica.probe = ReplicaState.UP, None
        log.info("router replica back", extra={"router": replica.address})
        self._on_back(replica)

    def _set(self, addresses: Sequence[str]) -> None:
        """The replicas become `addresses`: new ones start up, gone ones retire (their channels
        close with the set; completions owed to them are dropped)."""
        known = {r.address: r for r in self.all}
        replicas = []
        for address in dict.fromkeys(addresses):
            if (replica := known.pop(address, None)) is None:
                channel = aio_channel(address, self._tls, _OPTIONS)
                replica = Replica(address, channel, router_pb2_grpc.RouterStub(channel))
                if self.resolved.is_set():
                    log.info("router replica added", extra={"router": address})
            replicas.append(replica)
        for gone in known.values():
            log.info("router replica removed", extra={"router": gone.address})
            gone.state = ReplicaState.DOWN
            gone.take_pending()
            if gone.probe is not None:
                gone.probe.cancel()
            self._retired.append(gone)
        self.all = replicas

    async def _follow_dns(self) -> None:
        while True:
            resolved: list[str] = []
            failed = False
            for name in self._dns_names:
                try:
                    resolved += await dns.resolve(name)
                except OSError as exc:
                    failed = True
                    log.warning("router DNS name does not resolve",
                                extra={"dns": name, "error": str(exc)})
            if not failed or resolved:  # a failed lookup keeps the replicas known so far
                self._set([*self._static, *resolved])
            self.resolved.set()
            await asyncio.sleep(self.dns_refresh_s)

    async def close(self) -> None:
        """Stops probing and resolving, and closes every channel."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in [*self.all, *self._retired]:
            await replica.channel.close()
