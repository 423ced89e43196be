"""The mock engine backend: a Dynamo-mocker-compatible simulator (no weights, real KV events)."""
from __future__ import annotations

from tandem.engines.mock.engine import MockEngine, create_mock_engine

__all__ = ["MockEngine", "create_mock_engine"]
