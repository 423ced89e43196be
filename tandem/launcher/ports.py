"""Free ports for what `tandem up` starts after it planned its ports: the planner, the metrics
pages it reads, and the workers it adds."""
from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel may offer it again once closed: take it soon)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def consecutive_free_ports(host: str, n: int) -> int:
    """The first of `n` consecutive ports nothing listens on now (frontend process i serves
    its metrics on the first + i)."""
    while True:
        first = free_port(host)
        if first + n <= 65536 and all(_is_free(host, first + i) for i in range(1, n)):
            return first


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
