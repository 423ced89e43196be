"""Fetching request images: data URLs, http(s) from a real local server, allow-listed local
files; every bad input is a clear InvalidRequest."""
from __future__ import annotations

import asyncio
import base64
import io
import pathlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from PIL import Image

from tandem.errors import InvalidRequest
from tandem.multimodal.fetch import MediaFetchConfig, MediaFetcher
from tandem.multimodal.image import content_hash


def png(side: int = 8) -> bytes:
    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


PNG = png()
BIG_PNG = png(300)  # > 200 KB: random pixels do not compress


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    never = asyncio.Event()

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def big(_: web.Request) -> web.Response:
        return web.Response(body=BIG_PNG, content_type="image/png")

    async def streamed_big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()  # no Content-Length: the limit applies while reading
        await response.prepare(request)
        await response.write(BIG_PNG)
        return response

    async def html(_: web.Request) -> web.Response:
        return web.Response(text="<html>not an image</html>", content_type="text/html")

    async def hang(_: web.Request) -> web.Response:
        await never.wait()  # answers never: the client's timeout must end the fetch
        return web.Response()

    async def to_image(_: web.Request) -> web.Response:
        raise web.HTTPFound("/image.png")

    async def to_other_loopback(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://127.0.0.2:{request.url.port}/image.png")

    async def loop(_: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    app = web.Application()
    for path, handler in [("/image.png", image), ("/big.png", big), ("/stream.png", streamed_big),
                          ("/page", html), ("/hang", hang), ("/redirect", to_image),
                          ("/escape", to_other_loopback), ("/loop", loop)]:
        app.router.add_get(path, handler)
    async with TestServer(app, host="127.0.0.1") as test_server:
        yield test_server


@pytest.fixture
async def fetcher(tmp_path: pathlib.Path) -> AsyncIterator[MediaFetcher]:
    config = MediaFetchConfig(max_file_size_mb=0.1, media_fetch_timeout_s=0.5,
                              allowed_local_media_path=str(tmp_path / "media"),
                              allowed_media_networks=("127.0.0.1/32",))
    fetcher = MediaFetcher(config)
    yield fetcher
    await fetcher.close()


async def test_data_url(fetcher: MediaFetcher) -> None:
    image = await fetcher.fetch_image(data_url(PNG))
    assert (image.data, image.mime_type, image.content_hash) == (PNG, "image/png",
                                                                 content_hash(PNG))


@pytest.mark.parametrize("url,message", [
    (data_url(b"not an image at all"), "not PNG, JPEG or WebP"),
    (data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 64), "cannot be decoded"),
    (data_url(PNG, "text/plain"), "got content of type 'text/plain'"),
    ("data:image/png," + "x" * 10, "must be base64"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64", "needs a ','"),
    (data_url(BIG_PNG), "larger than the 0.1 MB limit"),
    ("ftp://example.com/a.png", "must be a data: URL"),
])
async def test_bad_data_urls(fetcher: MediaFetcher, url: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        await fetcher.fetch_image(url, param="messages[0].content[1]")
    assert info.value.param == "messages[0].content[1]"


async def test_http(fetcher: MediaFetcher, server: TestServer) -> None:
    for path in ("/image.png", "/redirect"):
        image = await fetcher.fetch_image(str(server.make_url(path)))
        assert image.data == PNG


@pytest.mark.parametrize("path,message", [
    ("/big.png", "larger than the 0.1 MB limit"),
    ("/stream.png", "larger than the 0.1 MB limit"),
    ("/page", "got content of type 'text/html'"),
    ("/missing", "returned HTTP 404"),
    ("/hang", r"timed out after 0.5 s"),
    ("/escape", "127.0.0.2 is not a public address"),
    ("/loop", "more than 5 redirects"),
])
async def test_bad_http_images(fetcher: MediaFetcher, server: TestServer, path: str,
                               message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        await fetcher.fetch_image(str(server.make_url(path)))


async def test_private_addresses_are_refused_unless_allow_listed(server: TestServer) -> None:
    fetcher = MediaFetcher(MediaFetchConfig())
    try:
        with pytest.raises(InvalidRequest, match="127.0.0.1 is not a public address"):
            await fetcher.fetch_image(str(server.make_url("/image.png")))
        # A name is checked where it is resolved, inside the connector.
        url = f"http://localhost:{server.port}/image.png"
        with pytest.raises(InvalidRequest, match="resolves to .*a non-public address"):
            await fetcher.fetch_image(url)
    finally:
        await fetcher.close()


async def test_local_files(fetcher: MediaFetcher, tmp_path: pathlib.Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(PNG)
    (media / "big.png").write_bytes(BIG_PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    assert (await fetcher.fetch_image(f"file://{media}/cat.png")).data == PNG
    assert (await fetcher.fetch_image(str(media / "cat.png"))).data == PNG
    for path, message in [(tmp_path / "secret.png", "outside the allowed media directory"),
                          (media / ".." / "secret.png", "outside the allowed media directory"),
                          (media / "link.png", "outside the allowed media directory"),
                          (media / "big.png", "larger than the 0.1 MB limit"),
                          (media / "absent.png", "cannot read the image file")]:
        with pytest.raises(InvalidRequest, match=message):
            await fetcher.fetch_image(f"file://{path}")
    closed = MediaFetcher(MediaFetchConfig())
    with pytest.raises(InvalidRequest, match="no --allowed-local-media-path"):
        await closed.fetch_image(f"file://{media}/cat.png")
