"""The fake `tensorrt_llm` (tests/fakes, built from TensorRT-LLM's own source) as a fixture:
a test module that imports `fake_trtllm` can import `tensorrt_llm` in its tests, and the
module is forgotten after them (other modules see TensorRT-LLM absent, as it is here)."""
from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import pytest

FAKES = pathlib.Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture(scope="module", autouse=True)
def fake_trtllm() -> Iterator[None]:
    """The fake `tensorrt_llm` importable for the importing module's tests only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(FAKES))
        yield
    for name in [m for m in sys.modules if m.partition(".")[0] == "tensorrt_llm"]:
        del sys.modules[name]
