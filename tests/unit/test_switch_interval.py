"""The thread switch interval every service process sets before it serves
(tandem.runtime.switch_interval)."""
from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tandem.runtime.switch_interval import DEFAULT_MS, ENV, configured_ms, shorten_switch_interval


@pytest.fixture(autouse=True)
def python_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    own = sys.getswitchinterval()
    monkeypatch.delenv(ENV, raising=False)
    sys.setswitchinterval(0.005)  # Python's default
    yield
    sys.setswitchinterval(own)


def test_pythons_interval_stays_unless_the_environment_sets_one() -> None:
    assert DEFAULT_MS == 0
    assert shorten_switch_interval() == pytest.approx(5.0)


def test_the_environment_shortens_it_and_never_lengthens_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    assert shorten_switch_interval() == pytest.approx(1.0)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    assert shorten_switch_interval(2.0) == pytest.approx(1.0)
    monkeypatch.setenv(ENV, "0.5")
    assert shorten_switch_interval() == pytest.approx(0.5)
    monkeypatch.setenv(ENV, "fast")
    assert configured_ms() == DEFAULT_MS
