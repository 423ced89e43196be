"""TLS and mutual TLS for every Tandem port, from one config block that all services share.

With `cert_file` set, a service serves TLS on its gRPC port (and the frontend on its HTTP port),
and every gRPC channel it opens to a peer (router, workers) is TLS too, verifying the peer
against `ca_file` (the system's roots when empty). With `require_client_cert` (mTLS), gRPC
servers refuse a client without a certificate signed by `ca_file`; a service presents its own
certificate as its client certificate. The frontend's HTTPS port follows require_client_cert
too, unless the frontend runs with --http-no-client-cert (API keys alone then authenticate its
HTTP clients).

grpc is imported where credentials are built, so that config modules without gRPC (the router's)
can hold a TlsConfig.
"""
from __future__ import annotations

import pathlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.errors import InvalidRequest
from tandem.runtime import unix_sockets

if TYPE_CHECKING:
    import grpc


@dataclass(frozen=True)
class TlsConfig:
    # == security ==
    #: PEM certificate chain this service presents; turns TLS on for its ports and for the
    #: gRPC channels it opens.
    cert_file: str = field(default="", metadata={"flag": "--tls-cert-file"})
    #: PEM private key of --tls-cert-file.
    key_file: str = field(default="", metadata={"flag": "--tls-key-file"})
    #: PEM CA bundle that peers' certificates are verified against; unset: the system's roots.
    ca_file: str = field(default="", metadata={"flag": "--tls-ca-file"})
    #: mTLS: gRPC ports and the frontend's HTTPS port refuse clients without a certificate
    #: signed by --tls-ca-file.
    require_client_cert: bool = field(default=False,
                                      metadata={"flag": "--tls-require-client-cert"})
    #: Name to verify in peers' certificates instead of the host of their address (one
    #: certificate shared by every pod).
    server_name: str = field(default="", metadata={"flag": "--tls-server-name"})

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidRequest("--tls-cert-file and --tls-key-file go together",
                                 param="tls.cert_file")
        if self.require_client_cert and not (self.cert_file and self.ca_file):
            raise InvalidRequest("--tls-require-client-cert needs --tls-cert-file, "
                                 "--tls-key-file and --tls-ca-file", param="tls.ca_file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


def _read(path: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"cannot read TLS file {path}: {exc.strerror}") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Credentials of a gRPC server port; with require_client_cert, client certificates are
    required and verified against ca_file."""
    import grpc
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=_read(tls.ca_file) if tls.require_client_cert else None,
        require_client_auth=tls.require_client_cert)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials of a channel to a peer: verify it against ca_file, present our certificate."""
    import grpc
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file) if tls.ca_file else None,
        private_key=_read(tls.key_file) if tls.cert_file else None,
        certificate_chain=_read(tls.cert_file) if tls.cert_file else None)


def aio_channel(address: str, tls: TlsConfig | None,
                options: Sequence[tuple[str, Any]] = (),
                ca_only_tls: bool = False) -> grpc.aio.Channel:
    """A channel to `address`: TLS when `tls` is enabled, plaintext otherwise. With
    `ca_only_tls`, a `tls` naming only a CA file means TLS too: a client (not a service) needs no
    certificate of its own to verify its peer. A plaintext channel to a local address whose
    server has a Unix-domain socket on this host dials the socket (unix_sockets.dial_target)."""
    import grpc
    secure = tls is not None and (tls.enabled or (ca_only_tls and bool(tls.ca_file)))
    if tls is None or not secure:
        return grpc.aio.insecure_channel(unix_sockets.dial_target(address),
                                         options=list(options))
    opts = list(options)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=opts)


def http_ssl_context(tls: TlsConfig, ask_client_cert: bool = True) -> ssl.SSLContext | None:
    """The HTTP listener's context (server side); None: plaintext. With require_client_cert
    (and `ask_client_cert`), a client without a certificate signed by ca_file is refused in
    the handshake, as on the gRPC ports."""
    if not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.require_client_cert and ask_client_cert:
            context.load_verify_locations(cafile=tls.ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"cannot load TLS files {tls.cert_file}, {tls.ca_file}: "
                             f"{exc}") from None
    return context
