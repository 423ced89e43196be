"""Unix-domain sockets between the processes of one host.

`tandem up` gives its children a private directory in `$TANDEM_UNIX_SOCKET_DIR`. A gRPC server
that binds a loopback or any-address TCP port P (plaintext, without SO_REUSEPORT) also binds
`<dir>/P.sock`, and a channel to a loopback address with port P dials that socket when it
exists. Every message between two local processes then skips the kernel's TCP stack (loopback
TCP's `sendmsg` was ~40% of a decode worker's busy time in py-spy). A decode worker also serves
Decode.Session as plain frames at `<dir>/P.session.sock`, which the frontend's sessions dial
instead of gRPC (services.decode.session_socket says why).

What stays TCP, on purpose:
- addresses, everywhere they are written or advertised (the router's worker list, logs, KV
  handles): other hosts dial them; only the dialing is rewritten, in `dial_target`;
- TLS: the socket would skip the peer verification that a TLS config asks for;
- SO_REUSEPORT servers (several frontend processes on one port): one path can belong to only
  one process, so a socket would take the kernel's spreading away; nothing in Tandem dials
  the frontend's ports, so nothing is lost;
- any process without the variable (Kubernetes, compose across containers, tests that start
  services one by one).

A server that dies leaves its socket file; a client then gets "connection refused" and retries
with gRPC's back-off, as on a closed TCP port, and the restarted server replaces the file.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

#: The directory of this host's sockets (set by `tandem up` for its children); unset: TCP only.
SOCKET_DIR_ENV = "TANDEM_UNIX_SOCKET_DIR"
#: sockaddr_un's sun_path holds 108 bytes with the terminating NUL.
MAX_PATH_BYTES = 107


def socket_dir() -> str:
    """The directory named by $TANDEM_UNIX_SOCKET_DIR; "" when unset (read on each call: the
    launcher sets it per child, and tests set and unset it)."""
    return os.environ.get(SOCKET_DIR_ENV, "")


def socket_path(directory: str, port: int) -> str:
    return os.path.join(directory, f"{port}.sock")


def session_socket_path(directory: str, port: int) -> str:
    """Where the decode worker of `port` serves Decode.Session as plain frames
    (services.decode.session_socket)."""
    return os.path.join(directory, f"{port}.session.sock")


def fits(directory: str, port: int = 65535) -> bool:
    """Whether the sockets for `port` in `directory` have paths the kernel accepts."""
    return len(os.fsencode(session_socket_path(directory, port))) <= MAX_PATH_BYTES


def is_local_host(host: str) -> bool:
    """Loopback (127.0.0.0/8, ::1, localhost) or the any-address (0.0.0.0, ::): a server
    there is reachable from this host's loopback, and a client dialing it reaches this host."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def split_address(address: str) -> tuple[str, int] | None:
    """`host:port` or `[v6]:port` as (host, port); None for other targets (`dns:///...`,
    `unix:...`, a name without a port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in address:
        return None
    if ":" in host and not host.startswith("["):
        return None  # a bare IPv6 address without brackets: not host:port
    return host, int(port)


def server_path(host: str, port: int) -> str | None:
    """Where a server bound to `host:port` also listens; None: TCP only (no directory, a host
    other hosts dial, or a path too long)."""
    directory = socket_dir()
    if not directory or not is_local_host(host) or not fits(directory, port):
        return None
    return socket_path(directory, port)


def session_server_path(host: str, port: int) -> str | None:
    """Where a decode worker bound to `host:port` serves Decode.Session as plain frames; None:
    only over gRPC (as server_path)."""
    path = server_path(host, port)
    return None if path is None else session_socket_path(os.path.dirname(path), port)


def session_dial_path(address: str) -> str | None:
    """The plain-frame Decode.Session socket of the decode worker at a local `address`, when
    it has one here; None: use gRPC."""
    directory = socket_dir()
    if not directory or (parts := split_address(address)) is None:
        return None
    host, port = parts
    path = session_socket_path(directory, port)
    return path if is_local_host(host) and os.path.exists(path) else None


def dial_target(address: str) -> str:
    """`unix:<dir>/<port>.sock` for a local `address` whose server has a socket here; else
    `address` unchanged."""
    directory = socket_dir()
    if not directory or (parts := split_address(address)) is None:
        return address
    host, port = parts
    path = socket_path(directory, port)
    if not is_local_host(host) or not os.path.exists(path):
        return address
    return f"unix:{path}"


def reserve(directory: str, port: int) -> None:
    """Leaves a socket file nobody listens on at `port`'s path (unless one is there), as a
    server that died does: a client that dials before the server binds gets "connection
    refused" and retries until the server replaces it (gRPC removes a stale socket file before
    binding). The launcher calls this before it starts a service, so that the channels its
    peers open before it listens dial the socket too."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock, \
            contextlib.suppress(OSError):  # there already
        sock.bind(socket_path(directory, port))
