"""Every relative link in README.md, docs/ and the benchmarks' pages leads to a file that exists
and, with a #fragment, to a heading of that file (GitHub's anchors)."""
from __future__ import annotations

import pathlib
import re

import pytest

from benchmarks.scoreboard import anchor

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(path: pathlib.Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: pathlib.Path) -> None:
    broken = []
    for match in _LINK.finditer(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, fragment = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
