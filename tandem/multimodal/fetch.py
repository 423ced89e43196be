"""Fetching the images of a request: `data:` URLs, http(s) URLs and allow-listed local files.

Every failure is an InvalidRequest (HTTP 400) that says what went wrong; nothing here raises
anything else for bad input. http(s) fetches have a size limit, a timeout covering the whole
fetch (redirects included), follow at most a few redirects, and never reach private, loopback,
link-local or otherwise non-global addresses unless their network is allow-listed: the check
runs inside the connector's DNS resolver, so a name cannot resolve to a public address for a
check and to a private one for the connection.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import pathlib
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from tandem.errors import InvalidRequest
from tandem.multimodal.image import check_image_bytes, content_hash, decode_image

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class MediaFetchConfig:
    """The frontend's limits on images in requests (flags: --max-file-size-mb, ...)."""

    #: Largest image file accepted, megabytes (data URLs after base64 decoding).
    max_file_size_mb: float = 50.0
    #: Longest an http(s) image fetch may take, redirects included, seconds.
    media_fetch_timeout_s: float = 10.0
    #: Most redirects an http(s) image fetch follows.
    max_media_redirects: int = 5
    #: Directory whose files (file:// URLs or absolute paths) requests may name; empty: local
    #: files are refused.
    allowed_local_media_path: str = ""
    #: Networks (CIDR) that http(s) image URLs may reach although they are private, loopback or
    #: link-local, e.g. 127.0.0.0/8 for tests; default none: public addresses only.
    allowed_media_networks: tuple[str, ...] = ()

    @property
    def max_bytes(self) -> int:
        return int(self.max_file_size_mb * 1024 * 1024)


@dataclass(frozen=True, slots=True)
class FetchedImage:
    """An image file that decodes, with its identity."""

    data: bytes
    mime_type: str
    #: tandem.multimodal.image.content_hash of data.
    content_hash: str


class _BlockedAddress(OSError):
    """A host resolved to an address requests may not reach."""


class _GuardedResolver(AbstractResolver):
    """aiohttp's threaded resolver, refusing names with any address outside the allowed set."""

    def __init__(self, is_allowed: Callable[[IpAddress], bool]) -> None:
        self._inner = aiohttp.ThreadedResolver()
        self._is_allowed = is_allowed

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            address = ipaddress.ip_address(result["host"])
            if not self._is_allowed(address):
                raise _BlockedAddress(f"{host} resolves to {address}, a non-public address")
        return results

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    """Loads image URLs for one frontend process. Create it on the event loop; `close` at exit."""

    def __init__(self, config: MediaFetchConfig) -> None:
        self.config = config
        try:
            self._networks = [ipaddress.ip_network(n, strict=False)
                              for n in config.allowed_media_networks]
        except ValueError as exc:
            raise InvalidRequest(f"allowed_media_networks: {exc}",
                                 param="allowed_media_networks") from exc
        root = config.allowed_local_media_path
        self._local_root = pathlib.Path(root).resolve() if root else None
        self._session: aiohttp.ClientSession | None = None

    async def fetch_image(self, url: str, *, param: str = "image_url") -> FetchedImage:
        """The image at `url`, checked to decode.

        Raises:
            InvalidRequest: an unsupported or malformed URL, a file too large, a fetch that fails
                or times out, a disallowed address or path, or bytes that are not a PNG, JPEG or
                WebP image that decodes.
        """
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        declared: str | None
        if scheme == "data":
            data, declared = self._from_data_url(url, param)
        elif scheme in ("http", "https"):
            data, declared = await self._from_http(url, param)
        elif scheme == "file" or url.startswith("/"):
            data, declared = await self._from_file(url, param), None
        else:
            raise InvalidRequest("an image URL must be a data: URL, an http(s):// URL or a local "
                                 f"file, got {_short(url)!r}", param=param)
        mime = check_image_bytes(data, declared, param=param)
        await asyncio.to_thread(decode_image, data, param=param)
        return FetchedImage(data, mime, content_hash(data))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- sources ------------------------------------------------------------------------------

    def _from_data_url(self, url: str, param: str) -> tuple[bytes, str]:
        header, comma, payload = url[len("data:"):].partition(",")
        if not comma:
            raise InvalidRequest("a data URL needs a ',' before its data", param=param)
        media_type, *options = header.split(";")
        if "base64" not in (o.strip().lower() for o in options):
            raise InvalidRequest("an image data URL must be base64 (data:image/png;base64,...)",
                                 param=param)
        if len(payload) * 3 // 4 > self.config.max_bytes + 3:
            raise self._too_large(param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(f"the data URL is not valid base64: {exc}", param=param) from exc
        if len(data) > self.config.max_bytes:
            raise self._too_large(param)
        return data, media_type.strip() or "text/plain"  # RFC 2397's default type

    async def _from_file(self, url: str, param: str) -> bytes:
        if self._local_root is None:
            raise InvalidRequest("local image files are not allowed (the server has no "
                                 "--allowed-local-media-path)", param=param)
        raw = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file:") \
            else url
        path = pathlib.Path(raw).resolve()  # symlinks and '..' resolved before the check
        if not path.is_relative_to(self._local_root):
            raise InvalidRequest(f"the image file {raw!r} is outside the allowed media "
                                 "directory", param=param)
        try:
            if path.stat().st_size > self.config.max_bytes:
                raise self._too_large(param)
            return await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            raise InvalidRequest(f"cannot read the image file {raw!r}: {exc.strerror}",
                                 param=param) from exc

    async def _from_http(self, url: str, param: str) -> tuple[bytes, str | None]:
        timeout = self.config.media_fetch_timeout_s
        try:
            return await asyncio.wait_for(self._get(url, param), timeout)
        except asyncio.TimeoutError as exc:
            raise InvalidRequest(f"fetching the image at {_short(url)} timed out after "
                                 f"{timeout:g} s", param=param) from exc
        except aiohttp.ClientConnectorError as exc:
            reason = exc.os_error if isinstance(exc.os_error, _BlockedAddress) else exc
            raise InvalidRequest(f"cannot fetch the image at {_short(url)}: {reason}",
                                 param=param) from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise InvalidRequest(f"fetching the image at {_short(url)} failed: {exc}",
                                 param=param) from exc

    async def _get(self, url: str, param: str) -> tuple[bytes, str | None]:
        session = self._session_now()
        for _ in range(self.config.max_media_redirects + 1):
            self._check_url(url, param)
            async with session.get(url, allow_redirects=False) as response:
                if response.status in _REDIRECTS:
                    location = response.headers.get("Location")
                    if not location:
                        raise InvalidRequest(f"{_short(url)} redirects nowhere", param=param)
                    url = urllib.parse.urljoin(url, location)
                    continue
                if response.status != 200:
                    raise InvalidRequest(f"fetching the image at {_short(url)} returned HTTP "
                                         f"{response.status}", param=param)
                if (response.content_length or 0) > self.config.max_bytes:
                    raise self._too_large(param)
                data = bytearray()
                async for chunk in response.content.iter_chunked(_CHUNK):
                    data += chunk
                    if len(data) > self.config.max_bytes:
                        raise self._too_large(param)
                return bytes(data), response.headers.get("Content-Type")
        raise InvalidRequest(f"fetching the image took more than "
                             f"{self.config.max_media_redirects} redirects", param=param)

    # ---- checks -------------------------------------------------------------------------------

    def _check_url(self, url: str, param: str) -> None:
        """Scheme and host of every hop; literal IP hosts are checked here because aiohttp
        connects to them without asking the resolver."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"cannot fetch {_short(url)}: only http(s) URLs with a host",
                                 param=param)
        try:
            address = ipaddress.ip_address(parts.hostname)
        except ValueError:
            return  # a name: the resolver checks what it resolves to
        if not self._is_allowed(address):
            raise InvalidRequest(f"cannot fetch {_short(url)}: {address} is not a public "
                                 "address", param=param)

    def _is_allowed(self, address: IpAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_global or any(address in net for net in self._networks)

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=_GuardedResolver(self._is_allowed))
            self._session = aiohttp.ClientSession(connector=connector,
                                                  headers={"User-Agent": "tandem"})
        return self._session

    def _too_large(self, param: str) -> InvalidRequest:
        return InvalidRequest(f"the image is larger than the {self.config.max_file_size_mb:g} MB "
                              "limit", param=param)


def _short(url: str, limit: int = 80) -> str:
    return url if len(url) <= limit else url[:limit] + "..."
