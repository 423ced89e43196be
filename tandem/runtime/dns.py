"""DNS names of peers that run several replicas (a Kubernetes headless Service): one name, one
address per ready pod, re-resolved as pods come and go."""
from __future__ import annotations

import asyncio
import socket

#: How an address list names a DNS name to expand (`dns:router-headless:9100`).
DNS_PREFIX = "dns:"


async def resolve(name: str) -> list[str]:
    """`host:port` -> every address the host resolves to now, as sorted `ip:port` strings
    (`[ip]:port` for IPv6).

    Raises:
        OSError: the name does not resolve.
    """
    host, _, port = name.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port),
                                                         type=socket.SOCK_STREAM)
    return sorted({f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6
                   else f"{info[4][0]}:{port}" for info in infos})
