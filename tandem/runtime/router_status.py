"""Router.ListWorkers on both sides: the snapshot to protobuf (router servicer), back from
protobuf (clients), and the client that `tandem status` and `tandem up` call."""
from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import grpc

from tandem.routing.snapshot import PoolSnapshot, RoutingSettings, WorkerSnapshot
from tandem.routing.workers import Health, LoadReport
from tandem.runtime import convert, status
from tandem.runtime.tls import TlsConfig, aio_channel
from tandem.v1 import kv_events_pb2, router_pb2, router_pb2_grpc

#: Trailing metadata key of a Route refused for the request's sake (no eligible healthy worker):
#: the router's verdict, which clients raise, as opposed to an outage of the router, which they
#: fail over (tandem.runtime.router_client).
ROUTER_VERDICT_KEY = "tandem-router-verdict"

_HEALTH_TO_PB = {Health.UNKNOWN: router_pb2.WORKER_HEALTH_UNSPECIFIED,
                 Health.SERVING: router_pb2.WORKER_HEALTH_SERVING,
                 Health.NOT_SERVING: router_pb2.WORKER_HEALTH_NOT_SERVING,
                 Health.UNREACHABLE: router_pb2.WORKER_HEALTH_UNREACHABLE}
_HEALTH_FROM_PB = {v: k for k, v in _HEALTH_TO_PB.items()}


def _load_to_pb(worker_id: str, load: LoadReport) -> kv_events_pb2.WorkerLoad:
    msg = kv_events_pb2.WorkerLoad(
        worker_id=worker_id, num_running=load.num_running, num_waiting=load.num_waiting,
        kv_blocks_used=load.kv_blocks_used, kv_blocks_total=load.kv_blocks_total,
        pending_prefill_tokens=load.pending_prefill_tokens,
        active_decode_blocks=load.active_decode_blocks,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate,
        timestamp_unix_ms=load.timestamp_unix_ms, devices=convert.devices_to_pb(load.devices))
    if load.served is not None:
        msg.served.CopyFrom(convert.served_to_pb(load.served))
    return msg


def load_from_pb(msg: kv_events_pb2.WorkerLoad) -> LoadReport:
    return LoadReport(msg.num_running, msg.num_waiting, msg.kv_blocks_used, msg.kv_blocks_total,
                      msg.pending_prefill_tokens, msg.active_decode_blocks,
                      msg.prefix_cache_hit_rate, msg.timestamp_unix_ms,
                      convert.served_from_pb(msg.served) if msg.HasField("served") else None,
                      convert.devices_from_pb(msg.devices))


def worker_to_pb(w: WorkerSnapshot) -> router_pb2.WorkerStatus:
    msg = router_pb2.WorkerStatus(
        worker_id=w.worker_id, address=w.address, candidate=w.candidate,
        health=_HEALTH_TO_PB[w.health], events_connected=w.events_connected, reason=w.reason,
        in_flight_requests=w.in_flight_requests, active_requests=w.active_requests,
        active_prefill_blocks=w.active_prefill_blocks,
        active_decode_blocks=w.active_decode_blocks, indexed_blocks=w.indexed_blocks)
    if w.last_load is not None and w.last_load_age_s is not None:
        msg.last_load.CopyFrom(_load_to_pb(w.worker_id, w.last_load))
        msg.last_load_age_ms = round(w.last_load_age_s * 1000)
    return msg


def worker_from_pb(msg: router_pb2.WorkerStatus) -> WorkerSnapshot:
    loaded = msg.HasField("last_load")
    return WorkerSnapshot(
        msg.worker_id, msg.address, msg.candidate,
        _HEALTH_FROM_PB.get(msg.health, Health.UNKNOWN), msg.events_connected, msg.reason,
        msg.in_flight_requests, msg.active_requests, msg.active_prefill_blocks,
        msg.active_decode_blocks, msg.indexed_blocks,
        load_from_pb(msg.last_load) if loaded else None,
        msg.last_load_age_ms / 1000 if loaded and msg.HasField("last_load_age_ms") else None)


def pools_to_pb(pools: Sequence[PoolSnapshot],
                settings: RoutingSettings | None = None) -> router_pb2.ListWorkersResponse:
    reply = router_pb2.ListWorkersResponse(pools=[
        router_pb2.PoolStatus(name=p.name, kind=p.kind, policy=p.policy,
                              workers=[worker_to_pb(w) for w in p.workers],
                              prefill_load_scale=p.prefill_load_scale,
                              temperature=p.temperature, host_hit_cost=p.host_hit_cost)
        for p in pools])
    if settings is not None:
        reply.settings.CopyFrom(router_pb2.RoutingSettings(
            block_size=settings.block_size, typical_osl=settings.typical_osl,
            grid_config_json=settings.grid_config_json))
    return reply


def pools_from_pb(msg: router_pb2.ListWorkersResponse) -> list[PoolSnapshot]:
    return [PoolSnapshot(p.name, p.kind, p.policy, tuple(worker_from_pb(w) for w in p.workers),
                         p.prefill_load_scale, p.temperature, p.host_hit_cost)
            for p in msg.pools]


def settings_from_pb(msg: router_pb2.ListWorkersResponse) -> RoutingSettings | None:
    """The router's decision settings; None from a router that does not send them."""
    if not msg.HasField("settings"):
        return None
    s = msg.settings
    return RoutingSettings(s.block_size, s.typical_osl, s.grid_config_json)


class RouterStatusClient:
    """ListWorkers calls to one router over one channel (TLS when `tls` is enabled). An API key
    goes out as `authorization: Bearer <key>` metadata, as the frontend's gRPC API takes it, so
    that a router behind a gateway that checks keys answers too (the router itself checks none:
    its port is internal, protected by mTLS). With `ca_only_tls`, a `tls` that names only a CA
    file is TLS too (a client that verifies the router but presents no certificate)."""

    def __init__(self, address: str, tls: TlsConfig | None = None, api_key: str = "",
                 ca_only_tls: bool = False) -> None:
        self.address = address
        self._channel = aio_channel(address, tls, ca_only_tls=ca_only_tls)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def list_workers(self, timeout_s: float = 10.0,
                           wait_for_ready: bool = False) -> list[PoolSnapshot]:
        """Every pool and worker as the router sees them.

        Raises:
            TandemError: the router failed or cannot be reached within `timeout_s`
                (Unavailable, DeadlineExceeded, ...), with the router's message.
        """
        try:
            reply = await self._stub.ListWorkers(router_pb2.ListWorkersRequest(),
                                                 timeout=timeout_s, metadata=self._metadata,
                                                 wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            raise status.from_rpc_error(exc, f"router {self.address}") from None
        return pools_from_pb(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RouterStatusClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()
