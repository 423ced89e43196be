"""One scrape round: every configured /metrics page fetched at once and parsed into a Scrape
(tandem.planner.exposition), each page's samples under its URL as the instance."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from tandem.planner.exposition import Scrape, parse_scrape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Round:
    scrape: Scrape
    #: Pages that did not answer (or answered garbage), with why.
    failed: dict[str, str]

    def missing_any(self, urls: Sequence[str]) -> bool:
        return any(url in self.failed for url in urls)


class Scraper:
    """Fetches the pages over one HTTP session. Not thread-safe; call from one loop."""

    def __init__(self, urls: Sequence[str], timeout_s: float) -> None:
        self.urls = list(dict.fromkeys(urls))
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def round(self) -> Round:
        """Every page now; one that fails is left out of the scrape and named in `failed`
        (never raises for a page)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        when = time.monotonic()
        texts = await asyncio.gather(*(self._fetch(url) for url in self.urls))
        pages, failed = {}, {}
        for url, (text, error) in zip(self.urls, texts, strict=True):
            if error:
                failed[url] = error
            else:
                pages[url] = text
        try:
            scrape = parse_scrape(pages, when)
        except ValueError as exc:  # one bad page spoils the round: parse page by page
            scrape, failed = self._parse_each(pages, when, failed, exc)
        return Round(scrape, failed)

    async def _fetch(self, url: str) -> tuple[str, str]:
        assert self._session is not None
        try:
            async with self._session.get(url) as reply:
                if reply.status != 200:
                    return "", f"HTTP {reply.status}"
                return await reply.text(), ""
        except (aiohttp.ClientError, TimeoutError) as exc:
            return "", f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _parse_each(pages: dict[str, str], when: float, failed: dict[str, str],
                    exc: ValueError) -> tuple[Scrape, dict[str, str]]:
        good = {}
        for url, text in pages.items():
            try:
                parse_scrape({url: text}, when)
            except ValueError as bad:
                failed = {**failed, url: f"not Prometheus text: {bad}"}
            else:
                good[url] = text
        return parse_scrape(good, when), failed

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
