"""The fakes of packages that cannot be installed here (tests/fakes: `tensorrt_llm` and
`visual_gen`, built from their own source) made importable for a while, then forgotten (other
tests see the package absent, as it is here). A test module that imports `fake_trtllm` gets
the fake `tensorrt_llm` for all its tests."""
from __future__ import annotations

import contextlib
import pathlib
import sys
from collections.abc import Iterator

import pytest

FAKES = pathlib.Path(__file__).resolve().parents[1] / "fakes"


@contextlib.contextmanager
def faked(package: str) -> Iterator[None]:
    """`package` imported from tests/fakes inside the block only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(FAKES))
        yield
    for name in [m for m in sys.modules if m.partition(".")[0] == package]:
        del sys.modules[name]


@pytest.fixture(scope="module", autouse=True)
def fake_trtllm() -> Iterator[None]:
    """The fake `tensorrt_llm` importable for the importing module's tests only."""
    with faked("tensorrt_llm"):
        yield
