"""`tandem serve router`."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.router.servicer import RouterServicer
from tandem.errors import InvalidRequest
from tandem.routing.round_robin import create_router
from tandem.routing.workers import WorkerRef
from tandem.runtime import config as config_lib
from tandem.runtime import logs, loop
from tandem.runtime.server import GrpcService, ServerOptions
from tandem.v1 import router_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 9100
    #: Decode worker addresses (host:port); each address is also the worker's id.
    decode_workers: list[str] = field(default_factory=list)
    #: Worker policy inside the decode pool. Only round_robin in this build.
    policy: str = "round_robin"
    grace_period_s: float = 30.0
    log_level: str = "info"


async def serve(config: RouterConfig) -> None:
    logs.setup("router", config.log_level)
    log.info("config", extra={"config": config_lib.as_dict(config)})
    if not config.decode_workers:
        raise InvalidRequest("router needs at least one --decode-workers address",
                             param="decode_workers")
    router = create_router(config.policy, [WorkerRef(a, a, "decode")
                                           for a in config.decode_workers])
    service = GrpcService(ServerOptions(config.host, config.port, config.grace_period_s),
                          ["tandem.v1.Router"])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router), service.server)
    await service.run()


def main(argv: Sequence[str]) -> None:
    config = config_lib.load(RouterConfig, argv, prog="tandem serve router",
                             description="Run the Tandem router.")
    loop.run(serve(config))
