"""gRPC server bootstrap shared by every Tandem service.

Standard health (grpc.health.v1) and reflection, the error interceptor, message-size limits, and
shutdown in this order on SIGTERM/SIGINT: health NOT_SERVING -> refuse new work -> drain in-flight
RPCs within the grace period -> stop the server -> run the service's close hooks (engine last).

While draining, the server still takes calls so that servicers refuse new work with UNAVAILABLE
(a clean, retryable answer); a server already stopping would reset them (CANCELLED or
UNAVAILABLE, depending on timing).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.runtime import unix_sockets
from tandem.runtime.draining import Draining
from tandem.runtime.gc_tuning import freeze_startup_heap, thaw
from tandem.runtime.health import NOT_SERVING, SERVING, HealthServicer
from tandem.runtime.interceptor import ErrorInterceptor
from tandem.runtime.switch_interval import shorten_switch_interval
from tandem.runtime.tls import TlsConfig, server_credentials

log = logging.getLogger(__name__)
CloseHook = Callable[[], Awaitable[None]]
#: What calls still open after the drain get before the server cancels them.
STOP_GRACE_S = 1.0


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    #: Seconds in-flight RPCs get to finish after SIGTERM.
    grace_s: float = 30.0
    max_message_bytes: int = 64 * 1024 * 1024
    #: TLS (mTLS with require_client_cert) on the port when enabled; plaintext otherwise.
    tls: TlsConfig | None = None
    #: SO_REUSEPORT on the server's ports: several processes bind the same port and the kernel
    #: spreads connections among them. Off, a port another process holds fails start-up.
    reuse_port: bool = False
    #: A second port this process alone binds (0: none), serving the same services: with
    #: `reuse_port`, its health says whether this process (not a random one) is ready.
    own_port: int = 0


class GrpcService:
    """Owns one grpc.aio server and its lifecycle. Typical use:

        service = GrpcService(options, service_names=[...])
        add_XServicer_to_server(servicer, service.server)
        service.on_close(engine.close)
        await service.run()          # returns after a graceful shutdown
    """

    def __init__(self, options: ServerOptions, service_names: Iterable[str]) -> None:
        self.options = options
        self.draining = Draining()
        self.service_names = list(service_names)
        limits = [("grpc.max_send_message_length", options.max_message_bytes),
                  ("grpc.max_receive_message_length", options.max_message_bytes),
                  ("grpc.so_reuseport", 1 if options.reuse_port else 0),
                  # Let routers keep long-lived streams alive with pings (see the watcher).
                  ("grpc.keepalive_permit_without_calls", 1),
                  ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000)]
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor(self.draining)],
                                      options=limits)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = self._bind(options.port)
        #: The Unix-domain socket this server also listens on (see unix_sockets); None: none.
        self.unix_path = self._bind_unix(self.port)
        if options.own_port:
            # The socket option is per server, so this port is bound with SO_REUSEPORT too;
            # whoever hands out own ports (the launcher) keeps them distinct.
            self._bind(options.own_port)
        self._start_hooks: list[CloseHook] = []
        self._close_hooks: list[CloseHook] = []
        self._drain_hooks: list[CloseHook] = []
        #: False for a service that reports SERVING itself once it can serve (the router).
        self.serve_when_started = True
        self._stop = asyncio.Event()

    def _bind(self, port: int) -> int:
        bind = f"{self.options.host}:{port}"
        if self.options.tls is not None and self.options.tls.enabled:
            bound = self.server.add_secure_port(bind, server_credentials(self.options.tls))
        else:
            bound = self.server.add_insecure_port(bind)
        if bound == 0:
            raise OSError(f"cannot bind gRPC port {bind}")
        return bound

    def _bind_unix(self, port: int) -> str | None:
        """Also listens on this host's socket for `port`, when `tandem up` gave a directory and
        the port is plaintext and this process's alone (see unix_sockets for why)."""
        tls = self.options.tls is not None and self.options.tls.enabled
        path = unix_sockets.server_path(self.options.host, port)
        if path is None or tls or self.options.reuse_port:
            return None
        try:
            bound = self.server.add_insecure_port(f"unix:{path}")
        except RuntimeError:
            bound = 0
        if not bound:
            # A socket file left here would make local clients dial nothing: they use TCP.
            with contextlib.suppress(OSError):
                os.unlink(path)
            log.warning("cannot bind a Unix socket; local clients use TCP",
                        extra={"path": path})
            return None
        return path

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def on_start(self, hook: CloseHook) -> None:
        """Runs once the gRPC server started, before health says SERVING (e.g. another
        listener's start)."""
        self._start_hooks.append(hook)

    def on_close(self, hook: CloseHook) -> None:
        """Runs after the drain, in registration order."""
        self._close_hooks.append(hook)

    def on_drain(self, hook: CloseHook) -> None:
        """Runs during the drain, alongside the gRPC server's (e.g. another listener's drain);
        it should finish within the grace period too."""
        self._drain_hooks.append(hook)

    def request_stop(self) -> None:
        self._stop.set()

    async def set_serving(self, serving: bool) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    async def start(self) -> None:
        await self.server.start()
        for hook in self._start_hooks:
            await hook()
        if self.serve_when_started:
            await self.set_serving(True)
        own = {"own_port": self.options.own_port} if self.options.own_port else {}
        unix = {"unix_socket": self.unix_path} if self.unix_path else {}
        log.info("serving", extra={"address": self.address, "services": self.service_names,
                                   **own, **unix})

    async def run(self) -> None:
        """Starts, waits for SIGTERM/SIGINT (or request_stop), then shuts down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        freeze_startup_heap()  # the process is built: no full GC pass scans it again
        shorten_switch_interval()  # TANDEM_SWITCH_INTERVAL_MS, where set
        await self.start()
        await self._stop.wait()
        await self.shutdown()
        thaw()

    async def shutdown(self) -> None:
        # What it had to finish when told to go (a planner's scale-down, a rolling update):
        # the operator's record that a drain, not a kill, ended those requests.
        log.info("draining", extra={"address": self.address, "grace_s": self.options.grace_s,
                                    "in_flight": self.draining.num_in_flight})
        self.draining.begin()
        await self.health.close()
        # Other listeners drain at the same time, so the whole drain fits one grace period.
        drained, *_ = await asyncio.gather(self.draining.wait_idle(self.options.grace_s),
                                           *(hook() for hook in self._drain_hooks))
        if not drained:
            log.warning("grace period over; cancelling what still runs",
                        extra={"in_flight": self.draining.num_in_flight})
        # Long-lived streams (health watches, KV event subscriptions) end here.
        await self.server.stop(STOP_GRACE_S)
        for hook in self._close_hooks:
            await hook()
        log.info("stopped")
